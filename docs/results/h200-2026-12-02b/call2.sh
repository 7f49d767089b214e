# Twentieth session, call 2: host-independent kernel time per step (replay_wall) base / new at batch 1,
# K = 0 and 3; embedded batch 32 plain vs K=3 on HEAD; m3-mini batch 1 plain base / new (the dense MLP's
# swiglu-oai epilogue).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; tar xzf _baseeed39a7.tgz -C $B; cp -r benchmarks $B/
rw() { timeout 90 python3 benchmarks/replay_wall.py --batch-sizes 1 --k 0,3 > $L/$1.log 2>&1; echo "[$((SECONDS-t0)) s] $1 exit $?"; grep "^{" $L/$1.log; }
(cd $B && PYTHONPATH=$B rw rw_base)
rw rw_new
(cd $B && PYTHONPATH=$B rw rw_base2)
rw rw_new2
timeout 120 python3 -m m3eagle bench --geometry embedded --batch-sizes 32 --max-tokens 128 --repeats 5 --json $L/b32.json > $L/b32.log 2>&1
echo "[$((SECONDS-t0)) s] b32 exit $?"; grep -A3 "^batch mode" $L/b32.log | tail -2; grep "spec / plain" $L/b32.log
mini() { timeout 100 python3 -m m3eagle bench --geometry m3-mini --batch-sizes 1 --max-tokens 64 --repeats 5 --num-draft-tokens 0 --json $L/$1.json > $L/$1.log 2>&1
  echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -A2 "^batch mode" $L/$1.log | tail -1; }
(cd $B && PYTHONPATH=$B mini mini_base)
mini mini_new
tar czf $OUT/logs.tgz -C $L .
