# Weights read before the PDL wait (design note 48: the decode GEMV's first weight tile, the router's expert
# rows), A/B in one tree with M3EAGLE_PDL_PRELOAD=0 / 1 alternating: the embedded pair and m3-mini at batch 1,
# the MoE layer's timing pass (issue 10's T = 1 bar), then the GPU test file (graph replay == eager under PDL).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $L/gpu.txt
emb() { M3EAGLE_PDL_PRELOAD=$2 timeout 80 python3 -m m3eagle bench --geometry embedded --batch-sizes 1 --max-tokens 128 --repeats 5 --kernel-table 30 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -3; }
mini() { M3EAGLE_PDL_PRELOAD=$2 timeout 80 python3 -m m3eagle bench --geometry m3-mini --batch-sizes 1 --max-tokens 64 --repeats 5 --kernel-table 30 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -3; }
emb emb_off 0; emb emb_on 1; emb emb_off2 0; emb emb_on2 1
mini mini_off 0; mini mini_on 1; mini mini_off2 0; mini mini_on2 1
for p in 0 1; do M3EAGLE_PDL_PRELOAD=$p timeout 70 python3 benchmarks/moe_kernel.py --shapes m3-mini --profile 1 --json $L/moe_p$p.json > $L/moe_p$p.log 2>&1
  echo "[$((SECONDS-t0)) s] moe preload=$p exit $?"; grep -E "% of copy" $L/moe_p$p.log | head -4; done
timeout 200 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
tar czf $OUT/logs.tgz -C $L .
