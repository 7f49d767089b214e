# Final tree: the GPU test file; m3-mini bench at batch 1 / 4 / 32 with the installed table.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 300 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
timeout 200 python3 -m m3eagle bench --geometry m3-mini --batch-sizes 1,4,32 --max-tokens 64 --repeats 5 --json $L/mini.json > $L/mini.log 2>&1
echo "[$((SECONDS-t0)) s] mini exit $?"; grep -A7 "^batch mode" $L/mini.log | tail -6
tar czf $OUT/logs.tgz -C $L .
