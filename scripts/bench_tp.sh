#!/usr/bin/env bash
# Tensor parallel on one host of 2 GPUs: the m3-8b bench (random weights, bf16, CUDA graphs, triton
# attention / MoE / fused ops, overlap on, greedy) at batch 1, 8, 32 with TP=1, then TP=2. Run from the
# repository root (python3 with torch 2.11 and PYTHONPATH set; no network needed):
#
#   OUT=<dir> bash scripts/bench_tp.sh
#
# Writes $OUT/bench_${GEOMETRY}_tp{1,2}.json (the bench's JSON document: env.tensor_parallel_size, per batch
# tok/s, step ms, GPU busy, comm_ms / comm_frac = NCCL kernel time per step and its share of the step,
# MBU over 2 x copy bandwidth at TP=2), the matching .log files, $OUT/env.txt and $OUT/summary.txt (TP=2 vs
# TP=1 side by side). Must finish in under 8 minutes: each run has its own time limit (RUN_S, default
# 200 s), and if the TP=2 run fails with CUDA graphs, it is retried once with --enforce-eager in the time
# left (logged as tp2_eager). Plain decoding by default (K=0); K=3 adds the speculative rows (about twice
# the time: raise RUN_S and mind the 8 minutes).
set -uo pipefail
OUT=${OUT:-out/tp}
K=${K:-0}
GEOMETRY=${GEOMETRY:-m3-8b}   # (the CPU dry run of this script: GEOMETRY=embedded BATCHES=1,4 EXTRA="--device cpu ...")
BATCHES=${BATCHES:-1,8,32}
EXTRA=${EXTRA:-}
RUN_S=${RUN_S:-200}
TOTAL_S=${TOTAL_S:-470}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0           # NVLink multicast off; exported, so the spawned TP workers inherit it
export KINETO_LOG_LEVEL=${KINETO_LOG_LEVEL:-5}
export M3EAGLE_TP_TIMEOUT=${M3EAGLE_TP_TIMEOUT:-120}  # a stuck collective fails the run instead of hanging it
export PYTHONUNBUFFERED=1
start=$SECONDS

{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1
  nvidia-smi topo -m 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" 2>&1
  env | grep -E '^(NCCL_|CUDA_VISIBLE|PYTHONPATH)' | sort
} > "$OUT/env.txt"

run() {  # run NAME LIMIT_S ARGS...
  local name=$1 limit=$2
  shift 2
  local log="$OUT/bench_${GEOMETRY}_$name.log"
  echo "+ python3 -m m3eagle bench --geometry $GEOMETRY $* (limit ${limit}s)" | tee "$log"
  local t0=$SECONDS
  # shellcheck disable=SC2086
  timeout --kill-after=10 "$limit" python3 -m m3eagle bench --geometry "$GEOMETRY" --batch-sizes "$BATCHES" \
    --max-tokens 32 --repeats 2 --decode-steps 10 --profile-steps 3 --num-draft-tokens "$K" \
    --json "$OUT/bench_${GEOMETRY}_$name.json" $EXTRA "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "[$name: rc=$rc, $((SECONDS - t0)) s]" | tee -a "$log"
  return "$rc"
}

run tp1 "$RUN_S" --tensor-parallel-size 1
if ! run tp2 "$RUN_S" --tensor-parallel-size 2; then
  left=$((TOTAL_S - (SECONDS - start)))
  if [ "$left" -gt 60 ]; then
    run tp2_eager "$left" --tensor-parallel-size 2 --enforce-eager
  else
    echo "no time left for the eager TP=2 retry ($left s)" | tee -a "$OUT/bench_${GEOMETRY}_tp2.log"
  fi
fi

python3 - "$OUT" "$GEOMETRY" > "$OUT/summary.txt" 2>&1 <<'PY'
import json, sys
from pathlib import Path
out, geo = Path(sys.argv[1]), sys.argv[2]
docs = {p.stem.removeprefix(f"bench_{geo}_"): json.loads(p.read_text()) for p in sorted(out.glob(f"bench_{geo}_*.json"))}
print(f"{'run':<10} {'batch':>5} {'mode':<5} {'tok/s':>9} {'step ms':>8} {'GPU busy ms':>11} {'comm ms':>8} "
      f"{'comm %':>6} {'MBU':>6}")
for name, d in docs.items():
    for r in d["results"]:
        st, rf = r["step"], r["roofline"]
        comm = st.get("comm_ms")
        print(f"{name:<10} {r['batch']:>5} {r['mode']:<5} {r['tok_s']['median']:>9.1f} {st['step_ms']:>8.2f} "
              f"{st['gpu_busy_ms'] or 0:>11.2f} {comm if comm is not None else float('nan'):>8.2f} "
              f"{(st.get('comm_frac') or 0) * 100:>5.0f}% {rf['mbu'] * 100:>5.1f}%")
base = {(r["batch"], r["mode"]): r for r in docs.get("tp1", {}).get("results", [])}
for name in ("tp2", "tp2_eager"):
    for r in docs.get(name, {}).get("results", []):
        b = base.get((r["batch"], r["mode"]))
        if b:
            print(f"{name} / tp1, batch {r['batch']} {r['mode']}: tok/s x{r['tok_s']['median'] / b['tok_s']['median']:.2f}, "
                  f"step ms x{r['step']['step_ms'] / b['step']['step_ms']:.2f}")
PY
cat "$OUT/summary.txt"
echo "[total: $((SECONDS - start)) s]"
