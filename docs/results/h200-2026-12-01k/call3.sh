# With the weight preload on (HEAD): the T = 1 tune for m3-mini and m3-8b (--write installs on the device's
# copy; the table comes back in logs/), the timing pass twice, then m3-8b at batch 1 with the seventeenth
# session's starting table (base_table.json of h200-2026-12-01j) against the table this call wrote.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/old8b; rm -rf $B; mkdir -p $B; cp -r m3eagle $B/
cp docs/results/h200-2026-12-01j/base_table.json $B/m3eagle/moe/tuned_configs.json
timeout 150 python3 benchmarks/moe_kernel.py --tune --write --buckets 1 --shapes m3-mini --json $L/tune_mini.json > $L/tune_mini.log 2>&1
echo "[$((SECONDS-t0)) s] m3-mini tune exit $?"; grep -E "best" $L/tune_mini.log | head -3
for i in 1 2; do timeout 70 python3 benchmarks/moe_kernel.py --shapes m3-mini --profile 1 --json $L/moe$i.json > $L/moe$i.log 2>&1
  echo "[$((SECONDS-t0)) s] timing $i exit $?"; grep -E "% of copy" $L/moe$i.log | head -2; done
timeout 170 python3 benchmarks/moe_kernel.py --tune --write --buckets 1 --shapes m3-8b --json $L/tune_8b.json > $L/tune_8b.log 2>&1
echo "[$((SECONDS-t0)) s] m3-8b tune exit $?"; grep -E "best" $L/tune_8b.log | head -3
cp m3eagle/moe/tuned_configs.json $L/tuned_configs.json
b8() { timeout 90 python3 -m m3eagle bench --geometry m3-8b --batch-sizes 1 --max-tokens 32 --repeats 3 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -3; }
(cd $B && PYTHONPATH=$B b8 m3_8b_old)
b8 m3_8b_new
tar czf $OUT/logs.tgz -C $L .
