# A shared expert of another width in the sorted grouped GEMMs (the embedded target at batch 32): the embedded
# bench at batch 32 with triton_moe.py of the commit before (call8_base.patch reversed) and with this tree, alternating; the
# MoE bench's checks at the embedded shape; the GPU test file.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; cp -r m3eagle $B/; (cd $B && git apply -R $OLDPWD/docs/results/h200-2026-12-01h/call8_base.patch)  # triton_moe.py of 5f2fb4a
bench() { timeout 120 python3 -m m3eagle bench --geometry embedded --batch-sizes 32 --max-tokens 128 --repeats 5 --num-scheduler-steps 8 --max-prefill-graph-tokens 2048 --kernel-table 14 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -2; }
(cd $B && PYTHONPATH=$B bench base)
bench new
(cd $B && PYTHONPATH=$B bench base2)
bench new2
timeout 100 python3 benchmarks/moe_kernel.py --shapes embedded --json $L/moe_emb.json > $L/moe_emb.log 2>&1
echo "[$((SECONDS-t0)) s] moe embedded exit $?"; grep -E "check|replay" $L/moe_emb.log | head -5
timeout 200 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
tar czf $OUT/logs.tgz -C $L .
