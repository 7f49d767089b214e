# The GPU test file on the retuned table (the final GEMV-preload PDL-graph test and _gate_up_rows' _load_k form
# have not run on a GPU); the MoE timing pass with kernel profiles at T = 1 and 2048 (where the routed time of
# a prefill chunk goes); m3-mini batch 1 with the old / new T = 1 entry alternating.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
T=m3eagle/moe/tuned_configs.json; cp $T /tmp/tuned_new.json
cp _tuned_old.json /tmp/tuned_old.json  # e6cabb3's table (an untracked copy)
timeout 220 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
timeout 80 python3 benchmarks/moe_kernel.py --shapes m3-mini --profile 1,2048 --json $L/moe.json > $L/moe.log 2>&1
echo "[$((SECONDS-t0)) s] moe exit $?"; grep -E "% of copy|profile|us  _" $L/moe.log | head -30
mini() { timeout 90 python3 -m m3eagle bench --geometry m3-mini --batch-sizes 1 --max-tokens 64 --repeats 5 --json $L/$1.json > $L/$1.log 2>&1
  echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -2; }
cp /tmp/tuned_old.json $T; mini mini_old
cp /tmp/tuned_new.json $T; mini mini_new
tar czf $OUT/logs.tgz -C $L .
