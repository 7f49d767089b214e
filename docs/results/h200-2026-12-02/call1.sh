# Issue 10: the m3-mini T=1 retune with the PDL weight preload on (eighteenth session's call3 ran past 150 s),
# timing passes before / after with the two tables alternating; then the GPU test file (the final form of the
# GEMV preload PDL-graph test and the _load_k rewrite of _gate_up_rows have not run on a GPU).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
T=m3eagle/moe/tuned_configs.json; cp $T $L/tuned_before.json
prof() { timeout 60 python3 benchmarks/moe_kernel.py --shapes m3-mini --profile 1 --json $L/$1.json > $L/$1.log 2>&1
  echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -E "% of copy" $L/$1.log | head -2; }
prof moe_before
timeout 330 python3 benchmarks/moe_kernel.py --tune --write --buckets 1 --shapes m3-mini --json $L/tune.json > $L/tune.log 2>&1
echo "[$((SECONDS-t0)) s] tune exit $?"; tail -5 $L/tune.log; cp $T $L/tuned_after.json
prof moe_after
cp $L/tuned_before.json $T; prof moe_before2
cp $L/tuned_after.json $T; prof moe_after2
tar czf $OUT/logs.tgz -C $L .
