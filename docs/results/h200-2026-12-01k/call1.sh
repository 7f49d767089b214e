# Owed by the seventeenth session: the embedded pair at batch 1 with norm_cat + _pair_weights (HEAD) against
# 3070508 alternating, the whole GPU test file (norm_cat and the m3-8b shared_down variant never ran on a GPU),
# m3-8b's T = 1 entry against its shared_down twins. The base tree travels as an untracked tarball.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; tar xzf _base3070508.tgz -C $B
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $L/gpu.txt
bench() { timeout 90 python3 -m m3eagle bench --geometry embedded --batch-sizes 1 --max-tokens 128 --repeats 5 --kernel-table 24 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -3; }
(cd $B && PYTHONPATH=$B bench base)
bench new
(cd $B && PYTHONPATH=$B bench base2)
bench new2
timeout 240 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED" $L/tests.log | head
timeout 150 python3 docs/results/h200-2026-12-01k/sweep_8b.py --json $L/sweep_8b.json > $L/sweep_8b.log 2>&1
echo "[$((SECONDS-t0)) s] sweep exit $?"; grep -E "us ok=|installed" $L/sweep_8b.log
tar czf $OUT/logs.tgz -C $L .
