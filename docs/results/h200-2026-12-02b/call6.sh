# Twentieth session, call 6: m3-8b batch 1 plain on the final tree (its dense MLPs now take the gate_up
# activation epilogue, its first norm the embedding lookup): the end-to-end check on the largest geometry and
# issue 9's MBU figure.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 200 python3 -m m3eagle bench --geometry m3-8b --batch-sizes 1 --max-tokens 32 --repeats 3 --num-draft-tokens 0 --kernel-table 12 --json $L/m3_8b.json > $L/m3_8b.log 2>&1
echo "[$((SECONDS-t0)) s] m3-8b exit $?"; grep -A2 "^batch mode" $L/m3_8b.log | head -2
tar czf $OUT/logs.tgz -C $L .
