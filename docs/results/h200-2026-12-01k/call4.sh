# The head MLP's activation in down's GEMV launch (design note 48), HEAD against b8db8ed (the preload
# commit, without it) on the embedded pair at batch 1 (GPU time per step: the host was noisy today); the GPU
# test file (incl. the new preload / silu-prologue PDL graph test); one more preload off / on pair of
# the MoE timing pass.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; tar xzf _baseb8db8ed.tgz -C $B
emb() { timeout 60 python3 -m m3eagle bench --geometry embedded --batch-sizes 1 --max-tokens 128 --repeats 5 --kernel-table 30 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -3; }
(cd $B && PYTHONPATH=$B emb emb_base)
emb emb_new
timeout 200 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
for p in 0 1; do M3EAGLE_PDL_PRELOAD=$p timeout 60 python3 benchmarks/moe_kernel.py --shapes m3-mini --profile 1 --json $L/moe_p$p.json > $L/moe_p$p.log 2>&1
  echo "[$((SECONDS-t0)) s] moe preload=$p exit $?"; grep -E "% of copy" $L/moe_p$p.log | head -1; done
tar czf $OUT/logs.tgz -C $L .
