# The sorted GEMMs' unmasked K loops (EVEN: shapes that divide into whole tiles) against 2d7e15b (masked),
# alternating, on the MoE timing pass with kernel profiles at T = 2048 (prefill chunks) and 256.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
B=/tmp/base; rm -rf $B; mkdir -p $B; tar xzf _base2d7e15b.tgz -C $B; cp -r benchmarks $B/
moe() { timeout 90 python3 benchmarks/moe_kernel.py --shapes m3-mini --profile 256,2048 --json $L/$1.json > $L/$1.log 2>&1
  echo "[$((SECONDS-t0)) s] $1 exit $?"; grep -E "% of copy" $L/$1.log | head -1; grep -E "profile T=2048|_kernel" $L/$1.log | tail -12; }
(cd $B && PYTHONPATH=$B moe base)
moe even
(cd $B && PYTHONPATH=$B moe base2)
moe even2
tar czf $OUT/logs.tgz -C $L .
