#!/usr/bin/env bash
# One run on one GPU (~4-5 min on an H200) that checks what the CPU cannot: run from the repository root,
#
#   OUT=<dir> bash scripts/check_gpu.sh
#
# 1. the GPU test file (graph replay == eager, sync-free steady state, the fused step-input kernel
#    bit-equal to the reference ops on CUDA, released graphs recapture) and the 128k-prompt test;
# 2. the embedded bench with its kernel table (kernels per step with the fused step inputs; the installed
#    draft head's acceptance on the GPU);
# 3. benchmarks/replay_wall.py: engine step vs host-only step vs back-to-back replay vs kernel time, which
#    tells a host-bound step, gaps inside the graph and a missing host/device overlap apart;
# 4. benchmarks/moe_kernel.py (routed MoE checks and timings, the shared expert fused) and the m3-mini
#    bench, while the call's time allows (each stage is skipped past its start deadline);
# 5. with FUSED=1, benchmarks/fused_ops.py (each fused op vs its reference in bf16) first; with M3_8B=1 the
#    m3-8b bench last; REPLAY=0 / MOE=0 skip stages 3 / 4's MoE part; MOE_TUNE=1 makes stage 4 retune the
#    MoE block table first (`moe_kernel.py --tune --write`, < 2 min on an H200) and return the rewritten
#    m3eagle/kernels/moe/tuned_configs.json as $OUT/tuned_configs.json, so the benches after it use the new table;
#    MSA=1 runs benchmarks/msa_step.py (MSA vs dense steps, kernel tables at 1k and 16k; MSA_ARGS replaces
#    those flags, MSA_TIMEOUT its 240 s limit) after the tests; MOE_TUNE_ARGS adds flags to the tune
#    (e.g. "--buckets 1,4"), MOE_ARGS flags to every moe_kernel.py run (e.g. "--profile 1,4,2048"); GEMV_ARGS runs benchmarks/gemv.py with those flags before stage 4;
#    PREFILL=1 runs the embedded bench a second time with --no-prefill-graphs (A/B in one call); TESTS=0 /
#    EMBEDDED=0 skip the GPU test file / the first embedded bench; TESTS_K selects tests (pytest -k),
#    TESTS_TIMEOUT replaces their 240 s limit; PDL_TESTS=1 / 0 runs them with M3EAGLE_PDL=1 / 0 (default auto).
#    MINI_PDL0=1 runs the m3-mini bench once more with M3EAGLE_PDL=0 (the default's A/B). PDL_AB=1: first
#    scripts/pdl_check.py (tokens with programmatic dependent launch on == off), then the embedded and the
#    m3-mini benches once more with M3EAGLE_PDL=1 (A/B in one call); MINI_BATCHES replaces "1,8,32";
#    MINI_AB="<flags>" runs the m3-mini bench once more with those flags (e.g. --no-prefill-graphs).
# Everything lands in $OUT/check.tgz (one file: the device tool brings back few, small files).
set -uo pipefail
OUT=${OUT:?set OUT}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} KINETO_LOG_LEVEL=5 PYTHONUNBUFFERED=1
W=$(mktemp -d)
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
if [[ ${FUSED:-0} == 1 ]]; then
  timeout 120 python3 benchmarks/fused_ops.py --json "$W/fused_ops.json" > /dev/null 2> "$W/fused_ops.log"
  stamp "fused_ops: exit $?"; grep -E "route|router|ties" "$W/fused_ops.log" | head -20
fi
if [[ ${PDL_AB:-0} == 1 ]]; then
  timeout 200 python3 scripts/pdl_check.py > "$W/pdl_check.json" 2> "$W/pdl_check.log"
  stamp "pdl_check: exit $? $(tail -1 "$W/pdl_check.json")"
fi
if [[ ${TESTS:-1} == 1 ]]; then
  stamp "GPU tests${PDL_TESTS:+ (M3EAGLE_PDL=$PDL_TESTS)}"
  M3EAGLE_PDL=${PDL_TESTS:-auto} timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -m gpu tests/engine/test_cuda_graphs.py tests/engine/test_long_context.py -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} > "$W/cuda_graphs.log" 2>&1
  stamp "GPU tests: exit $? ($(tail -1 "$W/cuda_graphs.log"))"
fi
if [[ ${MSA:-0} == 1 ]]; then
  # shellcheck disable=SC2086  # MSA_ARGS is a list of flags
  timeout "${MSA_TIMEOUT:-240}" python3 benchmarks/msa_step.py ${MSA_ARGS:---no-sweep --profile 1024 16384} \
    --json "$W/msa_step.json" > /dev/null 2> "$W/msa_step.log"
  stamp "msa_step: exit $?"; grep -E "^ +[0-9]+ +[0-9]x|target|: indexer|check" "$W/msa_step.log"
fi
if [[ ${EMBEDDED:-1} == 1 ]]; then
  timeout 150 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 \
    --kernel-table 25 --json "$W/bench_embedded.json" > "$W/bench_embedded.log" 2>&1
  stamp "embedded bench: exit $?"
  grep -A 6 "^batch mode" "$W/bench_embedded.log"
  if [[ ${PDL_AB:-0} == 1 ]]; then
    M3EAGLE_PDL=1 timeout 150 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 \
      --repeats 5 --kernel-table 25 --json "$W/bench_embedded_pdl.json" > "$W/bench_embedded_pdl.log" 2>&1
    stamp "embedded bench, M3EAGLE_PDL=1: exit $?"
    grep -A 6 "^batch mode" "$W/bench_embedded_pdl.log"
  fi
fi
if [[ ${PREFILL:-0} == 1 ]]; then
  timeout 150 python3 -m m3eagle bench --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 5 \
    --kernel-table 25 --no-prefill-graphs --json "$W/bench_embedded_eager_prefill.json" > "$W/bench_embedded_eager_prefill.log" 2>&1
  stamp "embedded bench --no-prefill-graphs: exit $?"
  grep -A 6 "^batch mode" "$W/bench_embedded_eager_prefill.log"
fi
if [[ ${REPLAY:-1} == 1 ]]; then
  timeout 120 python3 benchmarks/replay_wall.py --profile > "$W/replay_wall.jsonl" 2> "$W/replay_wall.log"
  stamp "replay_wall: exit $?"
  grep "engine step" "$W/replay_wall.log"
fi
pack() { tar czf "$OUT/check.tgz" -C "$W" .; }
pack
if [[ -n ${GEMV_ARGS:-} ]]; then
  # shellcheck disable=SC2086  # GEMV_ARGS is a list of flags
  timeout "${GEMV_TIMEOUT:-150}" python3 benchmarks/gemv.py ${GEMV_ARGS} --json "$W/gemv.json" > "$W/gemv.log" 2>&1
  stamp "gemv ${GEMV_ARGS}: exit $?"; grep -E "TUNED|^ *\(|speedup|x \|" "$W/gemv.log" | head -60
  pack
fi
if [[ ${MOE:-1} == 1 ]] && (( SECONDS - t0 < ${MOE_DEADLINE:-330} )); then
  tune=(); [[ ${MOE_TUNE:-0} == 1 ]] && tune=(--tune --write)
  # shellcheck disable=SC2206  # MOE_TUNE_ARGS is a list of flags, e.g. "--buckets 1,4"
  [[ ${MOE_TUNE:-0} == 1 && -n ${MOE_TUNE_ARGS:-} ]] && tune+=(${MOE_TUNE_ARGS})
  # shellcheck disable=SC2206  # MOE_ARGS too, e.g. "--shapes m3-mini --profile 1,4,2048"
  [[ -n ${MOE_ARGS:-} ]] && tune+=(${MOE_ARGS})
  timeout 330 python3 benchmarks/moe_kernel.py "${tune[@]}" --json "$W/moe_kernel.json" > /dev/null 2> "$W/moe_kernel.log"
  stamp "moe_kernel ${tune[*]}: exit $?"
  [[ ${MOE_TUNE:-0} == 1 ]] && cp m3eagle/kernels/moe/tuned_configs.json "$OUT/"
  grep -E "best|^ +(T|[0-9]+) |HBM|check|profile|^ +[0-9.]+ us" "$W/moe_kernel.log"
  pack
fi
if (( SECONDS - t0 < ${MINI_DEADLINE:-420} )); then
  timeout 140 python3 -m m3eagle bench --geometry m3-mini --batch-sizes "${MINI_BATCHES:-1,8,32}" --max-tokens 64 \
    --repeats 5 --kernel-table 30 --json "$W/bench_m3-mini.json" > "$W/bench_m3-mini.log" 2>&1
  stamp "m3-mini bench: exit $?"
  grep -A 7 "^batch mode" "$W/bench_m3-mini.log"
  if [[ ${MINI_PDL0:-0} == 1 ]]; then
    M3EAGLE_PDL=0 timeout 140 python3 -m m3eagle bench --geometry m3-mini --batch-sizes "${MINI_BATCHES:-1,8,32}" \
      --max-tokens 64 --repeats 5 --kernel-table 30 --json "$W/bench_m3-mini_pdl0.json" > "$W/bench_m3-mini_pdl0.log" 2>&1
    stamp "m3-mini bench, M3EAGLE_PDL=0: exit $?"
    grep -A 7 "^batch mode" "$W/bench_m3-mini_pdl0.log"
  fi
  if [[ -n ${MINI_AB:-} ]]; then
    # shellcheck disable=SC2086  # MINI_AB is a list of flags, e.g. "--no-prefill-graphs"
    timeout 140 python3 -m m3eagle bench --geometry m3-mini --batch-sizes "${MINI_BATCHES:-1,8,32}" --max-tokens 64 \
      --repeats 5 --kernel-table 30 ${MINI_AB} --json "$W/bench_m3-mini_ab.json" > "$W/bench_m3-mini_ab.log" 2>&1
    stamp "m3-mini bench ${MINI_AB}: exit $?"
    grep -A 7 "^batch mode" "$W/bench_m3-mini_ab.log"
  fi
  if [[ ${PDL_AB:-0} == 1 ]]; then
    M3EAGLE_PDL=1 timeout 140 python3 -m m3eagle bench --geometry m3-mini --batch-sizes "${MINI_BATCHES:-1,8,32}" \
      --max-tokens 64 --repeats 5 --kernel-table 30 --json "$W/bench_m3-mini_pdl.json" > "$W/bench_m3-mini_pdl.log" 2>&1
    stamp "m3-mini bench, M3EAGLE_PDL=1: exit $?"
    grep -A 7 "^batch mode" "$W/bench_m3-mini_pdl.log"
  fi
  pack
fi
if [[ ${M3_8B:-0} == 1 ]] && (( SECONDS - t0 < ${M3_8B_DEADLINE:-450} )); then
  timeout 100 python3 -m m3eagle bench --geometry m3-8b --batch-sizes 1,8,32 --max-tokens 32 --repeats 3 \
    --kernel-table 30 --json "$W/bench_m3-8b.json" > "$W/bench_m3-8b.log" 2>&1
  stamp "m3-8b bench: exit $?"; grep -A 7 "^batch mode" "$W/bench_m3-8b.log"; pack
fi
stamp "done"
