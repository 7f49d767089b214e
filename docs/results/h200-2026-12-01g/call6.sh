export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5
L=$OUT/logs; mkdir -p $L; t0=$SECONDS
run() { tag=$1; shift
  timeout 80 python3 -m m3eagle bench --batch-sizes 1,32 --max-tokens 128 --repeats 5 "$@" --json $L/$tag.json > $L/$tag.log 2>&1
  echo "[$((SECONDS-t0)) s] $tag ($*) exit $?"; grep -A5 "^batch mode" $L/$tag.log | tail -4; grep "spec / plain" $L/$tag.log | head -1; }
run emb_n8_pg2048 --geometry embedded --num-scheduler-steps 8 --max-prefill-graph-tokens 2048
run emb_n4_pg2048 --geometry embedded --num-scheduler-steps 4 --max-prefill-graph-tokens 2048
run emb_n1 --geometry embedded
tar czf $OUT/logs.tgz -C $L .
