# Graph launch cost vs kernel count; the GPU test file with the new m3-mini table; m3-8b decode tune.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 60 python3 docs/results/h200-2026-12-01h/graph_launch.py > $L/graph_launch.log 2>&1
echo "[$((SECONDS-t0)) s] graph_launch exit $?"; grep kernels: $L/graph_launch.log
timeout 300 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
timeout 200 python3 benchmarks/moe_kernel.py --tune --write --buckets 1 --shapes m3-8b --json $L/moe8b.json > $L/moe8b.log 2>&1
echo "[$((SECONDS-t0)) s] m3-8b tune exit $?"; grep -E "best|% of copy|% of mm" $L/moe8b.log | head -6
tar czf $OUT/logs.tgz -C $L .
