# The engine graphs' launch cost and node structure (graph_nodes.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
OUT=$L timeout 200 python3 docs/results/h200-2026-12-01h/graph_nodes.py > $L/graph_nodes.log 2>&1
echo "[$((SECONDS-t0)) s] graph_nodes exit $?"; grep '^{' $L/graph_nodes.log; tail -3 $L/graph_nodes.log

tar czf $OUT/logs.tgz -C $L .
