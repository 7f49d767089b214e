export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 250 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head -20
for n in 1 8; do
  timeout 90 python3 benchmarks/replay_wall.py --batch-sizes 1,32 --k 0,3 --steps 40 --num-scheduler-steps $n > $L/replay_n$n.json 2> $L/replay_n$n.log
  echo "[$((SECONDS-t0)) s] replay_wall N=$n exit $?"; grep "engine step" $L/replay_n$n.log
done
for args in "1" "8" "1 --max-prefill-graph-tokens 2048" "8 --max-prefill-graph-tokens 2048"; do
  tag=$(echo $args | tr -d ' -')
  timeout 100 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 --num-scheduler-steps $args --json $L/emb_$tag.json > $L/emb_$tag.log 2>&1
  echo "[$((SECONDS-t0)) s] embedded N=$args exit $?"; grep -A5 "^batch mode" $L/emb_$tag.log | tail -4; grep "spec / plain" $L/emb_$tag.log | head -1
done
tar czf $OUT/logs.tgz -C $L .
