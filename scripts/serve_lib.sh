# Sourced by bench_serve.sh and bench_serve_tail.sh: the server's wheels, the health probe and a clean stop.
# The caller sets PORT, TMP (removed at exit) and WHEELS.

# need_packages "IMPORTS" PACKAGE...: when one of the space-separated import names is missing, install the
# packages from $WHEELS (the device machine has no package index).
need_packages() {
  local imports=$1
  shift
  if ! python -c "import ${imports// /, }" 2>/dev/null; then
    echo "+ installing the server's dependencies from $WHEELS"
    python -m pip install -q --no-index --find-links "$WHEELS" "$@"
  fi
}

healthy() {
  python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$PORT/health" 2>/dev/null
}

# wait_healthy LOG TIMEOUT_S: until $SERVER answers /health; its death (LOG's tail shown) or the timeout exits 1.
wait_healthy() {
  local log=$1 limit=$2 t0=$SECONDS
  until healthy; do
    if ! kill -0 "$SERVER" 2>/dev/null; then echo "the server died:" >&2; tail -30 "$log" >&2; exit 1; fi
    if [ $((SECONDS - t0)) -gt "$limit" ]; then echo "the server was not ready after $limit s" >&2; exit 1; fi
    sleep 0.5
  done
}

SERVER=""
SERVER_RC=""
stop_server() {
  if [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM "$SERVER"
    SERVER_RC=0
    wait "$SERVER" || SERVER_RC=$?
    echo "[server exited with status $SERVER_RC after SIGTERM]"
  fi
  SERVER=""
}
trap 'stop_server; rm -rf "$TMP"' EXIT

# thread_cpu PID FILE: the process's CPU seconds per thread name (user + system, from /proc; threads of one name
# summed) and the wall clock, as JSON in FILE: {"wall": s, "threads": {name: s}}. Two snapshots around a run give
# each thread's utilization (the engine thread vs the event loop vs the tokenizer pool): where a served tail
# comes from when the process, not the GPU, is the bottleneck. Linux only; {} elsewhere.
thread_cpu() {
  python - "$1" "$2" <<'PYEOF'
import json, os, sys, time
pid, out = sys.argv[1], sys.argv[2]
tick, threads = os.sysconf("SC_CLK_TCK"), {}
try:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        threads[name] = threads.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
except OSError:
    pass
json.dump({"wall": time.monotonic(), "threads": threads}, open(out, "w"))
PYEOF
}
