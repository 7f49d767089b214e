#!/usr/bin/env bash
# Serving tail latency of a freshly started server, and the tool-call / structured-output workloads, on one GPU.
# Run from the repository root:
#
#   OUT=<dir> bash scripts/bench_serve_tail.sh
#
# 1. `m3eagle serve --device cuda --num-draft-tokens 3` with the default flags (warm-up on) and an empty
#    TRITON_CACHE_DIR, so every Triton kernel compiles in this process as for a new user; the time until
#    /health answers 200 is recorded (weights, warm-up). Then `m3eagle bench-serve` (stdlib prompts,
#    INPUT_LEN in / OUTPUT_LEN out, EOS ignored, greedy, no unmeasured warm-up requests) at max concurrency
#    8 (N8 prompts) and 32 (N32 prompts), then the `tools` and `json` workloads at concurrency 8 (N_CHAT each).
# 2. The same server with --num-draft-tokens 0 (fresh Triton cache too): tools and json at concurrency 8.
# Each server is stopped with SIGTERM and must exit 0.
#
# Writes under $OUT (default out/serve_tail):
#   serve_tail.json  {"spec": {"ready_s", "stdlib_c8", "stdlib_c32", "tools_c8", "json_c8", "server_exit"},
#                     "plain": {"ready_s", "tools_c8", "json_c8", "server_exit"}, "settings": {...}}
#                    each *_cN is bench-serve's JSON (TTFT / TPOT / ITL p50 / p90 / p99, throughput, acceptance)
#                    with "server_threads" (each server thread's CPU use over the run, 1.0 = a core),
#                    and per mode "first_use": the Triton compiles and CUDA graph captures the server logged after
#                    its warm-up (counts and the lines: what the warm-up missed)
#   serve_tail_<mode>_server.log  the server's log (its warm-up line says what it covered and how long it took)
#   serve_tail_<mode>_bench.log   bench-serve's progress and tables
#   raw/<mode>/<workload>.json    each bench-serve document as it lands (a run cut short keeps what finished)
# Expected wall time on an H100: about 4 minutes (two startups with warm-up, ~1 min of load).
#
# The server needs fastapi, uvicorn, prometheus-client, httpx and xgrammar. A machine without them and without
# internet installs them from a wheelhouse (WHEELS, default wheels/py312: built for Python 3.12 with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 ...`).
#
# A dry run on CPU (tiny numbers; warm-up is off by default there):
#   DEVICE=cpu INPUT_LEN=16 OUTPUT_LEN=4 N8=4 N32=4 N_CHAT=2 C_HIGH=2 OUT=/tmp/tail bash scripts/bench_serve_tail.sh
set -euo pipefail
OUT=${OUT:-out/serve_tail}
PORT=${PORT:-8321}
WHEELS=${WHEELS:-wheels/py312}
DEVICE=${DEVICE:-cuda}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
N8=${N8:-200}        # prompts at concurrency 8
N32=${N32:-400}      # prompts at the high concurrency
C_HIGH=${C_HIGH:-32}
N_CHAT=${N_CHAT:-64} # prompts of each chat workload (tools, json) at concurrency 8
READY_TIMEOUT=${READY_TIMEOUT:-600}
SERVE_ARGS=${SERVE_ARGS:-}  # extra `m3eagle serve` flags (--no-warmup: the old behaviour; --max-prefill-graph-tokens 2048)
MODES=${MODES:-spec plain}  # which servers to run
TMP=$(mktemp -d)
mkdir -p "$OUT"

source "$(dirname "$0")/serve_lib.sh"
need_packages "fastapi uvicorn prometheus_client httpx xgrammar jinja2 uvloop httptools" fastapi uvicorn prometheus-client httpx xgrammar jinja2 uvloop httptools

# bench NAME CONCURRENCY PROMPTS DATASET K: one bench-serve run into $TMP/<mode>/NAME.json
bench() {
  local name=$1 c=$2 n=$3 dataset=$4 k=$5
  echo "+ bench-serve --dataset $dataset --max-concurrency $c --num-prompts $n" | tee -a "$OUT/serve_tail_${MODE}_bench.log"
  thread_cpu "$SERVER" "$TMP/$MODE/$name.cpu0"
  python -m m3eagle bench-serve --base-url "http://127.0.0.1:$PORT" --max-concurrency "$c" --num-prompts "$n" \
    --dataset "$dataset" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --warmup 0 \
    --label "embedded K=$k $DEVICE fresh server, $dataset" --json "$TMP/$MODE/$name.json" 2>&1 \
    | tee -a "$OUT/serve_tail_${MODE}_bench.log"
  thread_cpu "$SERVER" "$TMP/$MODE/$name.cpu1"
  mkdir -p "$OUT/raw/$MODE"
  cp "$TMP/$MODE/$name.json" "$OUT/raw/$MODE/" 2>/dev/null || true  # kept as it lands: a cut run keeps its workloads
}

run_mode() {
  MODE=$1
  local k
  case $MODE in
    spec) k=3 ;;
    plain) k=0 ;;
  esac
  mkdir -p "$TMP/$MODE"
  # An empty compile cache: the Triton kernels compile in this server, as on a new user's first start.
  local cache="$TMP/$MODE/triton-cache"
  mkdir -p "$cache"
  # shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
  echo "+ TRITON_CACHE_DIR=$cache python -m m3eagle serve --device $DEVICE --num-draft-tokens $k --port $PORT $SERVE_ARGS" \
    | tee "$OUT/serve_tail_${MODE}_server.log"
  # shellcheck disable=SC2086
  TRITON_CACHE_DIR="$cache" python -m m3eagle serve --device "$DEVICE" --num-draft-tokens "$k" --port "$PORT" \
    --log-interval 5 $SERVE_ARGS >>"$OUT/serve_tail_${MODE}_server.log" 2>&1 &
  SERVER=$!
  local t0=$SECONDS
  wait_healthy "$OUT/serve_tail_${MODE}_server.log" "$READY_TIMEOUT"
  local ready=$((SECONDS - t0))
  echo "[$MODE: ready after $ready s]" | tee "$OUT/serve_tail_${MODE}_bench.log"
  echo "$ready" >"$TMP/$MODE/ready_s"
  grep -h "warm-up" "$OUT/serve_tail_${MODE}_server.log" | tail -2 || true
  if [ "$MODE" = spec ]; then
    bench stdlib_c8 8 "$N8" stdlib "$k"
    bench "stdlib_c$C_HIGH" "$C_HIGH" "$N32" stdlib "$k"
  fi
  bench tools_c8 8 "$N_CHAT" tools "$k"
  bench json_c8 8 "$N_CHAT" json "$k"
  stop_server >>"$OUT/serve_tail_${MODE}_bench.log" 2>&1
  echo "$SERVER_RC" >"$TMP/$MODE/server_exit"
  tail -1 "$OUT/serve_tail_${MODE}_bench.log"
}

for m in $MODES; do
  case $m in spec|plain) run_mode "$m" ;; *) echo "MODES: spec and/or plain, not $m" >&2; exit 2 ;; esac
done

python - "$TMP" "$OUT/serve_tail.json" "$INPUT_LEN" "$OUTPUT_LEN" "$DEVICE" "$SERVE_ARGS" "$OUT" <<'EOF'
import json, pathlib, sys
tmp, out, inp, outp, device, args, logs = sys.argv[1:]
doc = {"settings": {"input_len": int(inp), "output_len": int(outp), "device": device, "serve_args": args,
                    "triton_cache": "empty per server"}}
for mode in ("spec", "plain"):
    d = pathlib.Path(tmp) / mode
    if not d.is_dir():
        continue
    m = {"ready_s": int((d / "ready_s").read_text()), "server_exit": int((d / "server_exit").read_text() or -1)}
    # first-use work after the warm-up, as the server logged it (Triton compiles, CUDA graph captures)
    log = pathlib.Path(logs) / f"serve_tail_{mode}_server.log"
    late = [ln.split(" WARNING ", 1)[-1].strip() for ln in (log.read_text().splitlines() if log.exists() else [])
            if "on first use, after the warm-up" in ln]
    m["first_use"] = {"compiles": sum("Triton compiled" in x for x in late),
                      "captures": sum("CUDA graph" in x for x in late), "lines": late[:50]}
    for f in sorted(d.glob("*.json")):
        m[f.stem] = json.loads(f.read_text())
        # the server's threads over the run: CPU seconds / wall seconds (1.0 = a whole core)
        c0, c1 = d / f"{f.stem}.cpu0", d / f"{f.stem}.cpu1"
        if c0.is_file() and c1.is_file():
            a, b = json.loads(c0.read_text()), json.loads(c1.read_text())
            wall = b["wall"] - a["wall"]
            m[f.stem]["server_threads"] = {n: round((v - a["threads"].get(n, 0.0)) / wall, 3)
                                           for n, v in sorted(b["threads"].items()) if wall > 0
                                           and v - a["threads"].get(n, 0.0) > 0.01 * wall}
    doc[mode] = m
json.dump(doc, open(out, "w"), indent=1)
print(f"wrote {out}")
for mode in ("spec", "plain"):
    for name, r in doc.get(mode, {}).items():
        if isinstance(r, dict) and "results" in r:
            res, t = r["results"], r["results"]["ttft_ms"]
            st, cl = r.get("server_ttft") or {}, r.get("client") or {}
            print(f"{mode:5s} {name:12s} TTFT p50 {t['p50']:8.1f} p99 {t['p99']:8.1f} ms  p99/p50 "
                  f"{t['p99'] / max(t['p50'], 1e-9):5.1f}  {res['output_throughput']:8.0f} tok/s  failed {res['failed']}"
                  f"  server TTFT p50 {st.get('p50') or 0:6.1f} p99 {st.get('p99') or 0:6.1f}"
                  f"  client CPU {cl.get('utilization') or 0:4.0%}  server threads {r.get('server_threads')}")
EOF
