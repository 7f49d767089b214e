export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 120 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -k "multi_step or sync" -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
timeout 60 python3 docs/results/h200-2026-12-01g/step_times.py > $L/step_times.log 2>&1
echo "[$((SECONDS-t0)) s] step_times exit $?"; grep -v INFO $L/step_times.log | tail -8
for n in 1 8 4 1 8; do
  i=$((i+1))
  timeout 80 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 --num-scheduler-steps $n --json $L/emb_${i}_n$n.json > $L/emb_${i}_n$n.log 2>&1
  echo "[$((SECONDS-t0)) s] embedded N=$n exit $?"; grep -A5 "^batch mode" $L/emb_${i}_n$n.log | tail -4; grep "spec / plain" $L/emb_${i}_n$n.log | head -1
done
for n in 1 4; do
  timeout 100 python3 -m m3eagle bench --geometry m3-mini --batch-sizes 1,32 --max-tokens 64 --repeats 5 --num-scheduler-steps $n --json $L/mini_n$n.json > $L/mini_n$n.log 2>&1
  echo "[$((SECONDS-t0)) s] m3-mini N=$n exit $?"; grep -A5 "^batch mode" $L/mini_n$n.log | tail -4
done
tar czf $OUT/logs.tgz -C $L .
