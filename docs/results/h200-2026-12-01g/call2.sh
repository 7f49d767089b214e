export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 200 python3 docs/results/h200-2026-12-01g/debug_ms.py > $L/debug.log 2>&1
echo "[$((SECONDS-t0)) s] debug exit $?"; grep "^K=" $L/debug.log; tail -3 $L/debug.log
tar czf $OUT/logs.tgz -C $L .
