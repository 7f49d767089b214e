# Twenty-first session, call 3: the kept fold (o_proj + residual, norm + gate_up + silu) against 0e1d201:
# its GPU tests first, replay_wall at batch 1, K = 0 / 3, alternating twice; the fold chain; the bench's
# kernel table; the GPU test file.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; tar xzf _base0e1d201.tgz -C $B; cp -r benchmarks $B/
timeout 120 python3 -m pytest -q -x -m gpu tests/test_cuda_graphs.py -p no:cacheprovider -k "norm_prologue" > $L/tests_new.log 2>&1
echo "[$((SECONDS-t0)) s] new tests exit $?: $(tail -1 $L/tests_new.log)"; grep -E "^FAILED|Error|assert" $L/tests_new.log | head
rw() { timeout 90 python3 benchmarks/replay_wall.py --batch-sizes 1 --k 0,3 > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep "^{" $L/$1.log; }
(cd $B && PYTHONPATH=$B rw rw_base)
rw rw_new
(cd $B && PYTHONPATH=$B rw rw_base2)
rw rw_new2
timeout 60 python3 benchmarks/fold_chain.py --t 1 --rounds 3 > $L/fold_t1.log 2>&1; echo "[$((SECONDS-t0)) s] fold t1"; grep "^{" $L/fold_t1.log
timeout 60 python3 benchmarks/fold_chain.py --t 4 --rounds 2 > $L/fold_t4.log 2>&1; echo "[$((SECONDS-t0)) s] fold t4"; grep "^{" $L/fold_t4.log
timeout 100 python3 -m m3eagle bench --geometry embedded --batch-sizes 1 --max-tokens 128 --repeats 5 --kernel-table 40 --json $L/emb.json > $L/emb.log 2>&1
echo "[$((SECONDS-t0)) s] emb exit $?"; grep -A3 "^batch mode" $L/emb.log | tail -2
timeout 200 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
tar czf $OUT/logs.tgz -C $L .
