#!/bin/bash
# Twenty-second session, call 2: a grid barrier in one persistent Triton kernel vs a dependent PDL launch
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 200 python3 benchmarks/grid_barrier.py > $L/barrier.json 2> $L/barrier.log
echo "[$((SECONDS-t0)) s] barrier exit $?"; cat $L/barrier.json; tail -5 $L/barrier.log
timeout 100 python3 benchmarks/grid_barrier.py --phases 60 --programs 16,32,64,132 > $L/barrier60.json 2>> $L/barrier.log
echo "[$((SECONDS-t0)) s] barrier60 exit $?"; cat $L/barrier60.json
tar czf $OUT/logs.tgz -C $L .
