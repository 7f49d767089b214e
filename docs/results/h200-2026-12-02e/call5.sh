#!/bin/bash
# Twenty-third session, call 5: is call4's batch-32 loss of num_scheduler_steps=auto a bench artifact? The bench
# sizes max_model_len by its steady-state steps x sub-steps (745 tokens with auto, 265 with 1). Here the N=1 arm
# takes --decode-steps 143 so that its max_model_len is also 745: auto / 1 alternating, same engine sizes.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
emb() { timeout 80 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 $2 --json $L/$1.json > $L/$1.log 2>&1
  echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A5 "^batch mode" $L/$1.log | tail -4 | cut -c1-60,130-175; grep "max_model_len" $L/$1.json | head -1; }
emb auto "--num-scheduler-steps auto"
emb n1 "--num-scheduler-steps 1 --decode-steps 143"
emb auto2 "--num-scheduler-steps auto"
emb n1b "--num-scheduler-steps 1 --decode-steps 143"
tar czf $OUT/logs.tgz -C $L .
