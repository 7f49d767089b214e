# gate_early / shared_down: their GPU tests first (a flag protocol bug would hang: timeout), the T = 1 sweep
# against the installed entries (--write installs a winner), the timing pass, m3-mini batch 1 with the
# session's starting table and the new one alternating, the whole GPU test file.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; cp -r m3eagle $B/
cp docs/results/h200-2026-12-01j/base_table.json $B/m3eagle/moe/tuned_configs.json
timeout 240 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -k route_shared -p no:cacheprovider > $L/tests_early.log 2>&1
echo "[$((SECONDS-t0)) s] early tests exit $?: $(tail -1 $L/tests_early.log)"; grep -E "^FAILED" $L/tests_early.log | head
timeout 200 python3 docs/results/h200-2026-12-01j/sweep_early.py --shapes m3-mini,m3-8b --write --json $L/sweep.json > $L/sweep.log 2>&1
echo "[$((SECONDS-t0)) s] sweep exit $?"; grep -E "T=1:|installed \{" $L/sweep.log
cp m3eagle/moe/tuned_configs.json $L/tuned_configs.json
timeout 90 python3 benchmarks/moe_kernel.py --shapes m3-mini --profile 1 --json $L/moe.json > $L/moe.log 2>&1
echo "[$((SECONDS-t0)) s] moe timing exit $?"; grep -E "% of copy|profile T=1" $L/moe.log | head -6
bench() { timeout 60 python3 -m m3eagle bench --geometry m3-mini --batch-sizes 1 --max-tokens 64 --repeats 5 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -3; }
(cd $B && PYTHONPATH=$B bench base)
bench new
(cd $B && PYTHONPATH=$B bench base2)
bench new2
tar czf $OUT/logs.tgz -C $L .
