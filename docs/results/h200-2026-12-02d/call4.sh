#!/bin/bash
# Twenty-second session, call 4: the argmax in the lm_head GEMV's launch (draft steps and the target's greedy
# pick) against 2a4c86d: GPU tests, critical path, replay_wall alternating twice, the bench.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; tar xzf _base2a4c86d.tgz -C $B; cp -r benchmarks $B/
timeout 240 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED|Error" $L/tests.log | head
rw() { timeout 90 python3 benchmarks/replay_wall.py --batch-sizes 1 --k 0,3 > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep "^{" $L/$1.log; }
(cd $B && PYTHONPATH=$B rw rw_base)
rw rw_new
(cd $B && PYTHONPATH=$B rw rw_base2)
rw rw_new2
timeout 120 python3 benchmarks/critical_path.py --k 0,3 > $L/critical.log 2> $L/critical.err
echo "[$((SECONDS-t0)) s] critical exit $?"; grep "kernels per step" $L/critical.log
timeout 100 python3 -m m3eagle bench --geometry embedded --batch-sizes 1 --max-tokens 128 --repeats 5 --kernel-table 40 --json $L/emb.json > $L/emb.log 2>&1
echo "[$((SECONDS-t0)) s] emb exit $?"; grep -A3 "^batch mode" $L/emb.log | tail -2
tar czf $OUT/logs.tgz -C $L .
