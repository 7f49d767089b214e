# The one-launch decode MoE layer (moe/one_launch.py): its GPU tests, then the T = 1 sweep against the
# installed three-launch entries (sweep.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 200 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -k "one_launch or route_shared" -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED|Error" $L/tests.log | head -5
timeout 330 python3 docs/results/h200-2026-12-01i/sweep.py --shapes m3-mini,embedded --json $L/sweep.json > $L/sweep.log 2>&1
echo "[$((SECONDS-t0)) s] sweep exit $?"; grep -E "installed|copy|no one" $L/sweep.log
tar czf $OUT/logs.tgz -C $L .
