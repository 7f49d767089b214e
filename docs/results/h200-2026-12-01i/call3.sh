# Several down column tiles per program (MoEConfig.down_rows, direct._direct_down_rows_kernel): its GPU
# tests; the T = 1 sweep against the installed entries (sweep_rows.py --write installs a winner); the MoE
# timing pass with the table it wrote; m3-mini batch 1 with the table before (a copy of the tree) and after.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; cp -r m3eagle $B/
timeout 150 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -k "direct_moe or route_shared" -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED|Error" $L/tests.log | head -5
timeout 240 python3 docs/results/h200-2026-12-01i/sweep_rows.py --shapes m3-mini,m3-8b --write --json $L/sweep_rows.json > $L/sweep_rows.log 2>&1
echo "[$((SECONDS-t0)) s] sweep exit $?"; grep -E "T=1:|installed \{" $L/sweep_rows.log
cp m3eagle/moe/tuned_configs.json $L/tuned_configs.json
timeout 150 python3 benchmarks/moe_kernel.py --shapes m3-mini --profile 1 --json $L/moe.json > $L/moe.log 2>&1
echo "[$((SECONDS-t0)) s] moe timing exit $?"; grep -E "% of copy|profile T=1" $L/moe.log | head -4
bench() { timeout 100 python3 -m m3eagle bench --geometry m3-mini --batch-sizes 1 --max-tokens 64 --repeats 5 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -2; }
(cd $B && PYTHONPATH=$B bench mini_before)
bench mini_after
tar czf $OUT/logs.tgz -C $L .
