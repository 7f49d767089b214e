#!/bin/bash
# Twenty-third session, call 3: num_scheduler_steps="auto" by default (8 sub-steps for models up to 1 GiB
# replaying graphs): the GPU test file, then the embedded pair's bench with the default (auto) and with
# --num-scheduler-steps 1 (the old default), alternating, in one call.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 300 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED|Error" $L/tests.log | head
emb() { timeout 100 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 $2 --json $L/$1.json > $L/$1.log 2>&1
  echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A5 "^batch mode" $L/$1.log | tail -4; grep "spec / plain" $L/$1.log; }
emb emb_auto ""
emb emb_n1 "--num-scheduler-steps 1"
emb emb_auto2 ""
emb emb_n1b "--num-scheduler-steps 1"
tar czf $OUT/logs.tgz -C $L .
