#!/bin/bash
# Twenty-second session, call 3: each kernel's increment on the batch-1 step's critical path, K = 0 and 3
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 200 python3 benchmarks/critical_path.py --k 0,3 > $L/critical.log 2> $L/critical.err
echo "[$((SECONDS-t0)) s] critical exit $?"; grep -v "^{" $L/critical.log | grep -v "^  *[0-9]" ; tail -3 $L/critical.err
tar czf $OUT/logs.tgz -C $L .
