# The split combine inside the attention launch (triton_kernels._combine_if_last): the GPU test file; the
# embedded bench at batch 1 (plain and K=3) with the attention files of the commit before (call2_base.patch
# reversed) and with this tree, alternating; m3-mini batch 1 once each.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; cp -r m3eagle $B/
(cd $B && git apply -R $OLDPWD/docs/results/h200-2026-12-01i/call2_base.patch)
bench() { timeout 120 python3 -m m3eagle bench --geometry $2 --batch-sizes 1 --max-tokens 128 --repeats 5 --kernel-table 14 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -2; }
(cd $B && PYTHONPATH=$B bench base embedded)
bench new embedded
(cd $B && PYTHONPATH=$B bench base2 embedded)
bench new2 embedded
(cd $B && PYTHONPATH=$B bench mini_base m3-mini)
bench mini_new m3-mini
timeout 300 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
tar czf $OUT/logs.tgz -C $L .
