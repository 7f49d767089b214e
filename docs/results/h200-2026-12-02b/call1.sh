# Twentieth session, call 1: the draft-step folds (HEAD) against eed39a7 (the last landing; an untracked
# tarball), the embedded pair at batch 1 plain and K=3 alternating twice; the GPU test file on HEAD.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; tar xzf _baseeed39a7.tgz -C $B; cp -r benchmarks $B/
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $L/gpu.txt
bench() { timeout 100 python3 -m m3eagle bench --geometry embedded --batch-sizes 1 --max-tokens 128 --repeats 5 --kernel-table 40 --json $L/$1.json > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A3 "^batch mode" $L/$1.log | tail -2; }
(cd $B && PYTHONPATH=$B bench base)
bench new
(cd $B && PYTHONPATH=$B bench base2)
bench new2
timeout 280 python3 -m pytest -q -m gpu tests/test_cuda_graphs.py -p no:cacheprovider > $L/tests.log 2>&1
echo "[$((SECONDS-t0)) s] tests exit $?: $(tail -1 $L/tests.log)"; grep -E "^FAILED|Error" $L/tests.log | head
tar czf $OUT/logs.tgz -C $L .
