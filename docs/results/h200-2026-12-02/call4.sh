# down's unmasked K loop alone (gate_up's was slower in call3 and is reverted) against 2d7e15b, alternating,
# on the MoE timing pass (T = 1, 4 with PDL) with kernel profiles at T = 256 and 2048.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; tar xzf _base2d7e15b.tgz -C $B; cp -r benchmarks $B/
moe() { timeout 90 python3 benchmarks/moe_kernel.py --shapes m3-mini --profile 256,2048 --json $L/$1.json > $L/$1.log 2>&1
  echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -E "% of copy" $L/$1.log | head -1; grep -E "profile T=2048|_kernel" $L/$1.log | grep -v "^{" | tail -7; }
(cd $B && PYTHONPATH=$B moe base)
moe down
(cd $B && PYTHONPATH=$B moe base2)
moe down2
tar czf $OUT/logs.tgz -C $L .
