# Twentieth session, call 5: the dense attention's split size at batch 1 (the target's dense layer and the
# Eagle3 head's three attention calls per K=3 step), replay_wall per forced minimum keys per split,
# alternating twice. 64 is the policy's value at these shapes; 512 leaves a ~300-key context unsplit.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
for rep in 1 2; do for mk in None 128 512; do
  timeout 90 python3 docs/results/h200-2026-12-02b/split_sweep.py $mk --batch-sizes 1 --k 0,3 > $L/split_${mk}_$rep.log 2>&1
  echo "[$((SECONDS-t0)) s] min_keys $mk rep $rep exit $?"; grep "^{" $L/split_${mk}_$rep.log | cut -c1-200
done; done
tar czf $OUT/logs.tgz -C $L .
