export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 250 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
run() { tag=$1; shift
  timeout 80 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 "$@" --json $L/$tag.json > $L/$tag.log 2>&1
  echo "[$((SECONDS-t0)) s] $tag ($*) exit $?"; grep -A5 "^batch mode" $L/$tag.log | tail -4; grep "spec / plain" $L/$tag.log | head -1; }
run n1 --num-scheduler-steps 1
run n8 --num-scheduler-steps 8
run n8_pg2048 --num-scheduler-steps 8 --max-prefill-graph-tokens 2048
run n1_pg2048 --num-scheduler-steps 1 --max-prefill-graph-tokens 2048
M3EAGLE_PDL=1 run n8_pg2048_pdl1 --num-scheduler-steps 8 --max-prefill-graph-tokens 2048
tar czf $OUT/logs.tgz -C $L .
