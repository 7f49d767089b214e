# replay() host time inside the engine's steady loop, device idle or busy at launch (loop_launch.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 200 python3 docs/results/h200-2026-12-01h/loop_launch.py > $L/loop_launch.log 2>&1
echo "[$((SECONDS-t0)) s] loop_launch exit $?"; grep '^{' $L/loop_launch.log; grep -v "^{" $L/loop_launch.log | grep -v INFO | tail -5
tar czf $OUT/logs.tgz -C $L .
