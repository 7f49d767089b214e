#!/usr/bin/env bash
# Serving numbers for the embedded model on one GPU. Run from the repository root:
#
#   OUT=<dir> bash scripts/bench_serve.sh [spec|plain]...      (default: spec plain)
#
# For each mode it starts `m3eagle serve` on the GPU (spec: the embedded Eagle3 head, K=3; plain: K=0),
# waits for /health, runs `m3eagle bench-serve` at max concurrency 1, 8 and 32 (stdlib prompts, 128 tokens in,
# 128 out, EOS ignored, greedy), then stops the server with SIGTERM and checks that it exits 0. Writes two
# files per mode under $OUT (default out/serve):
#   serve_<mode>.json  {"concurrency_1": doc, "concurrency_8": doc, "concurrency_32": doc, "server_exit": rc}
#                      where doc is bench-serve's JSON (TTFT/TPOT/ITL p50/p90/p99, throughput, acceptance)
#   serve_<mode>.log   the server's log (periodic stats lines: throughput, queue, KV usage, acceptance), then
#                      bench-serve's progress and tables
# Expected wall time: ~1 min of startup (weights, CUDA graph capture) plus about a minute of load per mode.
#
# The server needs fastapi, uvicorn and prometheus-client. A machine without them and without internet can
# install them from a wheelhouse: build one here with
#   pip download fastapi uvicorn prometheus-client -d out/wheels --only-binary=:all: \
#       --python-version 3.11 --platform manylinux2014_x86_64
# and carry out/wheels to the device (WHEELS=out/wheels is the default).
#
# A quick dry run on CPU: DEVICE=cpu INPUT_LEN=16 OUTPUT_LEN=8 MIN_PROMPTS=4 PER_SLOT=1 bash scripts/bench_serve.sh spec
set -euo pipefail
OUT=${OUT:-out/serve}
PORT=${PORT:-8321}
WHEELS=${WHEELS:-out/wheels}
DEVICE=${DEVICE:-cuda}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
MIN_PROMPTS=${MIN_PROMPTS:-32}  # prompts per run: max(MIN_PROMPTS, PER_SLOT * concurrency)
PER_SLOT=${PER_SLOT:-8}
TMP=$(mktemp -d)
mkdir -p "$OUT"

source "$(dirname "$0")/serve_lib.sh"
need_packages "fastapi uvicorn prometheus_client uvloop httptools" fastapi uvicorn prometheus-client uvloop httptools

run_mode() {
  local mode=$1 k
  case $mode in
    spec) k=3 ;;
    plain) k=0 ;;
    *) echo "usage: $0 [spec|plain]..." >&2; exit 2 ;;
  esac
  local log="$OUT/serve_$mode.log"
  echo "+ python -m m3eagle serve --device $DEVICE --num-draft-tokens $k --port $PORT" | tee "$TMP/server.log"
  python -m m3eagle serve --device "$DEVICE" --num-draft-tokens "$k" --port "$PORT" --log-interval 5 \
    >>"$TMP/server.log" 2>&1 &
  SERVER=$!
  local t0=$SECONDS
  wait_healthy "$TMP/server.log" 300
  echo "[$mode: ready after $((SECONDS - t0)) s]" | tee "$TMP/bench.log"
  for c in 1 8 32; do
    local n=$((c * PER_SLOT > MIN_PROMPTS ? c * PER_SLOT : MIN_PROMPTS))
    echo "+ bench-serve --max-concurrency $c --num-prompts $n" | tee -a "$TMP/bench.log"
    python -m m3eagle bench-serve --base-url "http://127.0.0.1:$PORT" --max-concurrency "$c" --num-prompts "$n" \
      --dataset stdlib --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --warmup 4 --label "embedded K=$k $DEVICE" \
      --json "$TMP/c$c.json" 2>&1 | tee -a "$TMP/bench.log"
  done
  stop_server >>"$TMP/bench.log" 2>&1
  tail -1 "$TMP/bench.log"
  cat "$TMP/server.log" "$TMP/bench.log" >"$log"
  python - "$TMP" "$OUT/serve_$mode.json" "$SERVER_RC" <<'EOF'
import json, sys
tmp, out, rc = sys.argv[1:]
doc = {f"concurrency_{c}": json.load(open(f"{tmp}/c{c}.json")) for c in (1, 8, 32)}
doc["server_exit"] = int(rc) if rc else None
json.dump(doc, open(out, "w"), indent=1)
print(f"wrote {out}")
EOF
}

modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(spec plain)
for m in "${modes[@]}"; do
  run_mode "$m"
done
