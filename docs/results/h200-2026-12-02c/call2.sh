# Twenty-first session, call 2: benchmarks/fold_chain.py at the commit with all three folds (T = 1 twice, T = 4:
# it stops at the first combination whose lm_head is tl.dot there).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; mkdir -p $OUT
python3 benchmarks/fold_chain.py --t 1 2>&1 | tee $OUT/fold_t1.log | grep "^{"
python3 benchmarks/fold_chain.py --t 1 2>&1 | tee $OUT/fold_t1b.log | grep "^{"
python3 benchmarks/fold_chain.py --t 4 2>&1 | tee $OUT/fold_t4.log | grep "^{"
