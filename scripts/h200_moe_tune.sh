#!/usr/bin/env bash
# One call on one H200 (~7 min): retune the routed-MoE block table, then re-measure the engine with it.
#
#   OUT=<dir> bash scripts/h200_moe_tune.sh
#
# 1. benchmarks/moe_kernel.py --tune --write: checks, the sweep (timing the experts as the engine runs them,
#    shared expert fused), the timing table; the rewritten m3eagle/moe/tuned_configs.json is copied to $OUT;
# 2. the m3-mini, embedded and m3-8b benches with the new table (each skipped past its start deadline).
# Results land in $OUT/tune.tgz (one file) and $OUT/tuned_configs.json.
set -uo pipefail
OUT=${OUT:?set OUT}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} KINETO_LOG_LEVEL=5 PYTHONUNBUFFERED=1
W=$(mktemp -d)
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
pack() { tar czf "$OUT/tune.tgz" -C "$W" .; }
timeout 330 python3 benchmarks/moe_kernel.py --tune --write --json "$W/moe_kernel.json" > /dev/null 2> "$W/moe_kernel.log"
stamp "moe_kernel --tune: exit $?"
cp m3eagle/moe/tuned_configs.json "$OUT/"
grep -E "best|^ +(T|[0-9]+) |HBM|check|passed|FAILED" "$W/moe_kernel.log"
pack
if (( SECONDS - t0 < 400 )); then
  timeout 100 python3 -m m3eagle bench --geometry m3-mini --batch-sizes 1,8,32 --max-tokens 64 --repeats 5 \
    --kernel-table 30 --json "$W/bench_m3-mini.json" > "$W/bench_m3-mini.log" 2>&1
  stamp "m3-mini bench: exit $?"; grep -A 7 "^batch mode" "$W/bench_m3-mini.log"; pack
fi
if (( SECONDS - t0 < 440 )); then
  timeout 80 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 \
    --kernel-table 25 --json "$W/bench_embedded.json" > "$W/bench_embedded.log" 2>&1
  stamp "embedded bench: exit $?"; grep -A 6 "^batch mode" "$W/bench_embedded.log"; pack
fi
if (( SECONDS - t0 < 470 )); then
  timeout 100 python3 -m m3eagle bench --geometry m3-8b --batch-sizes 1,8,32 --max-tokens 32 --repeats 3 \
    --kernel-table 30 --json "$W/bench_m3-8b.json" > "$W/bench_m3-8b.log" 2>&1
  stamp "m3-8b bench: exit $?"; grep -A 7 "^batch mode" "$W/bench_m3-8b.log"; pack
fi
stamp "done"
