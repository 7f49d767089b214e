# A narrower shared expert fused into the direct MoE kernels (the embedded target): embedded bench at batch 1
# with the four MoE files of the commit before (call7_base.patch reversed) and with this tree; the embedded decode tune;
# the bench again with the table it wrote; the GPU test file.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; cp -r m3eagle $B/
(cd $B && git apply -R $OLDPWD/docs/results/h200-2026-12-01h/call7_base.patch)  # the four MoE files of aefc217
bench() { timeout 120 python3 -m m3eagle bench --geometry embedded --batch-sizes 1 --max-tokens 128 --repeats 5 --kernel-table 12 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -2; }
(cd $B && PYTHONPATH=$B bench base)
bench new
(cd $B && PYTHONPATH=$B bench base2)
bench new2
timeout 150 python3 benchmarks/moe_kernel.py --tune --write --buckets 1,4 --shapes embedded --json $L/moe_emb.json > $L/moe_emb.log 2>&1
echo "[$((SECONDS-t0)) s] embedded tune exit $?"; grep -E "best|% of copy" $L/moe_emb.log | head -4
bench tuned
timeout 280 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
cp m3eagle/moe/tuned_configs.json $L/tuned_configs.json
tar czf $OUT/logs.tgz -C $L .
