# Does replay() block on the previous replay of the same graph exec? (graph_block.py)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
timeout 200 python3 docs/results/h200-2026-12-01h/graph_block.py > $L/graph_block.log 2>&1
echo "[$((SECONDS-t0)) s] graph_block exit $?"; grep '^{' $L/graph_block.log; grep -v "^{" $L/graph_block.log | grep -v INFO | tail -5
tar czf $OUT/logs.tgz -C $L .
