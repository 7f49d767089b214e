#!/bin/bash
# Twenty-second session, call 1: does relaunching a CUDA graph still in flight block the host?
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $L/gpu.txt 2>&1
timeout 200 python3 benchmarks/graph_relaunch.py --engine --k 0,3 > $L/relaunch.json 2> $L/relaunch.log
echo "[$((SECONDS-t0)) s] relaunch exit $?"; grep -v INFO $L/relaunch.log | grep -v Warn
timeout 60 python3 benchmarks/graph_relaunch.py --nodes 70 > $L/relaunch70.json 2> $L/relaunch70.log
echo "[$((SECONDS-t0)) s] relaunch70 exit $?"; cat $L/relaunch70.log
tar czf $OUT/logs.tgz -C $L .
