# m3-mini's T = 1 MoE layer with the installed entry: five timing passes in one call, 100 graph replays
# per measurement (default 30), for the distribution of issue 10's T = 1 figure.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
for i in 1 2 3 4 5; do
  timeout 60 python3 benchmarks/moe_kernel.py --shapes m3-mini --reps 100 --json $L/moe$i.json > $L/moe$i.log 2>&1
  echo "[$((SECONDS-t0)) s] pass $i exit $?"; grep -E "% of copy" $L/moe$i.log | head -1
done
tar czf $OUT/logs.tgz -C $L .
