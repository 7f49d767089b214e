#!/bin/bash
# Twenty-third session, call 1: where the batch-1 step's first kernels spend their time (the sampled-position
# launch moved after the forward in an experiment tree, _exp.tgz, valid for pure decode / verify steps only),
# then the embedded pair's bench on HEAD (default, and 8 sub-steps with full-budget prefill graphs) and the
# replayed step times at batch 1 and 32.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
E=/tmp/exp; rm -rf $E; mkdir -p $E; tar xzf _exp.tgz -C $E
timeout 100 python3 benchmarks/critical_path.py --k 0,3 > $L/critical.log 2> $L/critical.err
echo "[$((SECONDS-t0)) s] critical exit $?"; grep "kernels per step" $L/critical.log
(cd $E && PYTHONPATH=$E timeout 100 python3 benchmarks/critical_path.py --k 0,3 > $L/critical_exp.log 2> $L/critical_exp.err)
echo "[$((SECONDS-t0)) s] critical_exp exit $?"; grep "kernels per step" $L/critical_exp.log
timeout 120 python3 benchmarks/replay_wall.py --batch-sizes 1,32 --k 0,3 > $L/rw.log 2>&1
echo "[$((SECONDS-t0)) s] rw exit $?"; grep "^{" $L/rw.log
timeout 150 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 --kernel-table 30 --json $L/emb.json > $L/emb.log 2>&1
echo "[$((SECONDS-t0)) s] emb exit $?"; grep -A5 "^batch mode" $L/emb.log | tail -4; grep "spec / plain" $L/emb.log
timeout 150 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 --num-scheduler-steps 8 --max-prefill-graph-tokens 2048 --json $L/emb_n8.json > $L/emb_n8.log 2>&1
echo "[$((SECONDS-t0)) s] emb_n8 exit $?"; grep -A5 "^batch mode" $L/emb_n8.log | tail -4; grep "spec / plain" $L/emb_n8.log
tar czf $OUT/logs.tgz -C $L .
