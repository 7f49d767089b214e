export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 330 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "FAILED|Error" $L/tests.log | head -20
for n in 1 4 8; do
  timeout 110 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 --num-scheduler-steps $n --json $L/emb_n$n.json > $L/emb_n$n.log 2>&1
  echo "[$((SECONDS-t0)) s] embedded N=$n exit $?"; grep -A6 "^batch mode" $L/emb_n$n.log; grep "spec / plain" $L/emb_n$n.log
done
tar czf $OUT/logs.tgz -C $L .
