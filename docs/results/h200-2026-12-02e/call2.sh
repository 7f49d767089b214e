#!/bin/bash
# Twenty-third session, call 2: why call1's default-settings K=3 steps were host-bound (0.39 ms of host per
# batch-1 step, 0.094 ms of it inside graph.replay(), against 0.012 ms for plain): CUDA runtime calls and
# cProfile of the steady engine step, K = 0 and 3, batch 1 and 32.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 240 python3 docs/results/h200-2026-12-02e/host_api.py > $L/host_api.log 2>&1
echo "[$((SECONDS-t0)) s] host_api exit $?"; grep "^===" $L/host_api.log
timeout 120 python3 benchmarks/replay_wall.py --batch-sizes 1 --k 3 --profile > $L/rw_prof.log 2>&1
echo "[$((SECONDS-t0)) s] rw_prof exit $?"; grep "^{" $L/rw_prof.log
tar czf $OUT/logs.tgz -C $L .
