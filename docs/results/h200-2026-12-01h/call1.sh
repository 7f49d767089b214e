# MoE decode layer: down's weight preload + the router / shared-expert launch (moe/direct.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 150 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -k "direct_moe or route_shared" -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED|Error" $L/tests.log | head -5
timeout 150 python3 -m m3eagle bench --geometry m3-mini --batch-sizes 1 --max-tokens 64 --repeats 5 --json $L/mini_before.json > $L/mini_before.log 2>&1
echo "[$((SECONDS-t0)) s] mini before exit $?"; grep -A3 "^batch mode" $L/mini_before.log | tail -2
timeout 330 python3 benchmarks/moe_kernel.py --tune --write --buckets 1,4 --shapes m3-mini --profile 1,4 --json $L/moe.json > $L/moe.log 2>&1
echo "[$((SECONDS-t0)) s] moe tune exit $?"; grep -E "best|% of copy|% of mm|copy bandwidth" $L/moe.log | head -12
cp m3eagle/moe/tuned_configs.json $L/tuned_configs_written.json
timeout 150 python3 -m m3eagle bench --geometry m3-mini --batch-sizes 1 --max-tokens 64 --repeats 5 --json $L/mini_after.json > $L/mini_after.log 2>&1
echo "[$((SECONDS-t0)) s] mini after exit $?"; grep -A3 "^batch mode" $L/mini_after.log | tail -2
tar czf $OUT/logs.tgz -C $L .
