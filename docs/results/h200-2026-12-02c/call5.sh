# Twenty-first session, call 5: the kept fold at the larger heads' shapes (m3-mini, m3-8b) at T = 1, and the
# embedded one again, in the PDL chain of benchmarks/fold_chain.py.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; mkdir -p $OUT
for g in m3-mini m3-8b embedded; do
  timeout 80 python3 benchmarks/fold_chain.py --geometry $g --t 1 --rounds 2 --iters 50 2>&1 | tee $OUT/fold_$g.log | grep "^{"
done
