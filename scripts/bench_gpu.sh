#!/usr/bin/env bash
# Offline benches of the three bench geometries on one GPU (`m3eagle bench`). Run from the repository root:
#
#   OUT=<dir> bash scripts/bench_gpu.sh [mini|8b|embedded|m3-fp8|8b-fp8|det|tree|tree-cost|bi-gemm|prefix-ttft|prefix-cost|all]
#   (default: all)
#
# Each run writes $OUT/bench_<name>.json (the JSON document) and $OUT/bench_<name>.log (progress + table);
# $OUT defaults to out/bench. Expected wall time on one H200 (estimates; the JSON's wall_s is the truth):
# mini ~2.5-3.5 min (incl. --compare-hf), 8b ~4-5 min, embedded ~1 min. To stay inside a 10-minute
# command, run "mini embedded" in one call and "8b" in another. det: m3-mini at batch 1 and 32 with the
# deterministic mode off, then on (K=3; tok/s and the replayed step of each, to read its cost), ~4-6 min.
# tree: the embedded pair at batch 1 and 32, chain K=3 against trees 3,4,16 and 6,4,32, all with overlap and
# decode graphs (trees choose their verify width per batch at startup; 3,4,16 also with the full tree forced at
# batch 1), and the chain at K = 1, 2, 4, 5, 6, 8 at batch 1 (the best chain is the tree's baseline), ~4-5 min.
# tree-cost: m3-mini, the chain K = 3 against the tree 3,2,3 (the same 4 verify rows), batch 1 and 32. bi-gemm: the deterministic
# GEMM's config sweep on m3-mini's shapes (benchmarks/batch_invariant_gemm.py -> $OUT/bi_gemm.json). prefix-ttft: engine-side TTFT, prefix cache on / off,
# m3-mini 4,096 shared + 128 own tokens, waves of 8, with prompt graphs up to 512 and up to 2,048 tokens
# (benchmarks/prefix_ttft.py -> $OUT/prefix_ttft_{512,2048}.json). prefix-cost: m3-mini at batch 1 and 32 (K=3,
# stdlib prompts that share nothing: the bench empties the cache before each repeat) with prefix caching on, then
# off -- what hashing and page bookkeeping cost where nothing hits, ~3 min.
set -euo pipefail
OUT=${OUT:-out/bench}
mkdir -p "$OUT"
export KINETO_LOG_LEVEL=${KINETO_LOG_LEVEL:-5}  # keep the profiler's own log lines out of the table

run() {
  local name=$1
  shift
  echo "+ python -m m3eagle bench $* --json $OUT/bench_$name.json" | tee "$OUT/bench_$name.log"
  local t0=$SECONDS
  python -m m3eagle bench "$@" --json "$OUT/bench_$name.json" 2>&1 | tee -a "$OUT/bench_$name.log"
  echo "[$name: $((SECONDS - t0)) s]" | tee -a "$OUT/bench_$name.log"
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(all)
for t in "${targets[@]}"; do
  case $t in
    mini) run m3-mini --geometry m3-mini --batch-sizes 1,8,32 --compare-hf ;;
    8b) run m3-8b --geometry m3-8b --batch-sizes 1,8,32 ;;
    embedded) run embedded --geometry embedded --batch-sizes 1,32 ;;
    m3-fp8)  # MiniMax-M3's real layer shapes, bf16 vs MXFP8, batch 1: its first 4 layers (3 dense + 1 MoE), then
      # 6 (two MoE layers more: the step difference / 2 is one MoE layer's, lm_head and sampling cancelled)
      for l in 4 6; do
        run m3-l$l-bf16 --geometry m3 --num-layers $l --batch-sizes 1 --num-draft-tokens 0 --repeats 3 --max-tokens 16
        run m3-l$l-fp8 --geometry m3 --num-layers $l --batch-sizes 1 --num-draft-tokens 0 --repeats 3 --max-tokens 16 \
          --quantization fp8
      done ;;
    8b-fp8)
      run m3-8b-b1-bf16 --geometry m3-8b --batch-sizes 1 --num-draft-tokens 0 --repeats 3 --max-tokens 16
      run m3-8b-b1-fp8 --geometry m3-8b --batch-sizes 1 --num-draft-tokens 0 --repeats 3 --max-tokens 16 \
        --quantization fp8 ;;
    det)
      run m3-mini-det-off --geometry m3-mini --batch-sizes 1,32 --max-tokens 64 --repeats 3
      run m3-mini-det-on --geometry m3-mini --batch-sizes 1,32 --max-tokens 64 --repeats 3 --deterministic ;;
    tree)
      run embedded-chain --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 3
      run embedded-tree3 --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 3 --draft-tree 3,4,16 \
        --overlap on
      run embedded-tree6 --geometry embedded --batch-sizes 1,32 --max-tokens 128 --repeats 3 --draft-tree 6,4,32 \
        --overlap on
      # the full 3,4,16 tree at batch 1 whatever the startup rule picks (it may take the narrow step everywhere)
      run embedded-tree3-full --geometry embedded --batch-sizes 1 --max-tokens 128 --repeats 3 --draft-tree 3,4,16 \
        --overlap on --tree-max-batch 1
      for k in 1 2 4 5 6 8; do  # the chain sweep at batch 1: the best chain is what a tree must beat
        run embedded-chain-k$k --geometry embedded --batch-sizes 1 --max-tokens 128 --repeats 3 --num-draft-tokens $k
      done ;;
    tree-cost)  # m3-mini (random weights): a tree's step against the chain's at equal verify rows (3 drafts each:
      # the chain K = 3, the tree 3,2,3 verified whole at every batch), so the difference is the tree's own work
      run m3-mini-chain3 --geometry m3-mini --batch-sizes 1,32 --max-tokens 64 --repeats 3 --num-draft-tokens 3 \
        --overlap on
      run m3-mini-tree-3-2-3 --geometry m3-mini --batch-sizes 1,32 --max-tokens 64 --repeats 3 --draft-tree 3,2,3 \
        --overlap on --tree-max-batch 32 ;;
    prefix-cost)
      run m3-mini-cache-on --geometry m3-mini --batch-sizes 1,32 --max-tokens 128 --repeats 5
      run m3-mini-cache-off --geometry m3-mini --batch-sizes 1,32 --max-tokens 128 --repeats 5 \
        --no-enable-prefix-caching ;;
    bi-gemm)
      python benchmarks/batch_invariant_gemm.py --geometry m3-mini --json "$OUT/bi_gemm.json" 2>&1 | tee "$OUT/bi_gemm.log" ;;
    prefix-ttft)
      for cap in 512 2048; do
        python benchmarks/prefix_ttft.py --geometry m3-mini --max-prefill-graph-tokens "$cap" --profile \
          --json "$OUT/prefix_ttft_$cap.json" 2>&1 | grep -v INFO | tee "$OUT/prefix_ttft_$cap.log"
      done ;;
    all)
      run m3-mini --geometry m3-mini --batch-sizes 1,8,32 --compare-hf
      run m3-8b --geometry m3-8b --batch-sizes 1,8,32
      run embedded --geometry embedded --batch-sizes 1,32
      ;;
    *) echo "usage: $0 [mini|8b|embedded|m3-fp8|8b-fp8|det|tree|bi-gemm|prefix-ttft|prefix-cost|all]..." >&2; exit 2 ;;
  esac
done
