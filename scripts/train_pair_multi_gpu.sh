#!/usr/bin/env bash
# Rebuild the embedded pair on one host of 2 GPUs from that machine's own site-packages.
#
#   STAGE=1 OUT=... bash scripts/train_pair_multi_gpu.sh   # corpus + tokens (CPU), target on GPU 0;
#                                                       # GPU 1: the GPU test file, then a head for the
#                                                       # shipped target on the new corpus (data effect)
#   STAGE=2 OUT=... bash scripts/train_pair_multi_gpu.sh   # two heads for the new target, in parallel:
#                                                       # GPU 0 without, GPU 1 with self-distillation
#   STAGE=3 OUT=... bash scripts/train_pair_multi_gpu.sh   # two head variants for the SHIPPED target, in
#                                                       # parallel (HEAD_A_ARGS / HEAD_B_ARGS; defaults:
#                                                       # draft vocab 6144, and TTT 7 steps with decay 0.9);
#                                                       # one call from a cold machine (data rebuilt first)
#   STAGE=4 HEADS="0:a:ARGS;1:b:ARGS;0:c:ARGS" ...       # any number of head variants for the shipped target,
#                                                       # in parallel (several may share a GPU)
#
# R (default /tmp/m3e15) survives between calls while the machine stays warm; a cold STAGE=2 rebuilds
# the (deterministic) corpus and reads the new target from $TARGET_PARTS (parts carried from stage 1).
# Each stage leaves at most 8 files in $OUT (transport.pack's parts + logs.tgz).
# SMOKE=1 runs the same plumbing on the CPU at toy sizes (a check before spending device time).
set -uo pipefail
export PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=5 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
STAGE=${STAGE:-1}
R=${R:-/tmp/m3e15}
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
M="$PY -m m3eagle.training"
SHIPPED=m3eagle/assets/default/target
TARGET_TIME=${TARGET_TIME:-240}
HEAD_TIME=${HEAD_TIME:-300}
OLD_HEAD_TIME=${OLD_HEAD_TIME:-180}
SD_ROWS=${SD_ROWS:-16384}
if [[ ${SMOKE:-0} == 1 ]]; then
  CORPUS_ARGS="--max-code-mb 0.4 --arith-problems 300"
  T_ARGS="--steps 2 --batch-size 2 --seq-len 64 --device cpu --log-every 1 --eval-every 1 --save-every 1"
  H_ARGS="--steps 2 --batch-size 2 --seq-len 64 --device cpu --log-every 1 --eval-every 1 --save-every 1 --simulate 2"
  SD_ROWS=4; GPU_TESTS=0
else
  CORPUS_ARGS=""
  T_ARGS="--time-budget $TARGET_TIME --log-every 50 --eval-every 500 --save-every 500"
  H_ARGS="--log-every 50 --eval-every 400 --save-every 1000 --simulate 48"
  GPU_TESTS=${GPU_TESTS:-1}
fi
mkdir -p "$R" "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

data() {  # corpus + token arrays with the shipped tokenizer (so vocab and ids stay those of today)
  $M corpus --out "$R/corpus" $CORPUS_ARGS > "$R/corpus.log" 2>&1 || { stamp "corpus FAILED"; tail -20 "$R/corpus.log"; return 1; }
  mkdir -p "$R/tok" && cp -n $SHIPPED/tokenizer.json "$R/tok/"
  $M tokenizer --corpus "$R/corpus" --out "$R/tok" > "$R/tok.log" 2>&1 || { stamp "tokenizer FAILED"; tail -20 "$R/tok.log"; return 1; }
  touch "$R/data.ready"
}

pack_dir() {  # pack_dir NAME TARGET_DIR DRAFT_DIR: a run dir in transport.pack's layout, from symlinks
  local d=$R/pack_$1; rm -rf "$d"; mkdir -p "$d"
  [[ -n $2 ]] && ln -s "$2" "$d/target"
  [[ -n $3 ]] && ln -s "$3" "$d/draft"
  echo "$d"
}

if [[ $STAGE == 1 ]]; then
  if [[ $GPU_TESTS == 1 ]]; then
    (CUDA_VISIBLE_DEVICES=1 timeout 300 $PY -m pytest -q -m gpu tests/engine/test_cuda_graphs.py -p no:cacheprovider \
       > "$R/cuda_graphs.log" 2>&1; echo "exit $?" >> "$R/cuda_graphs.log") &
    TESTS=$!
  fi
  stamp "data"; data || exit 1; stamp "data ready"; cp "$R/corpus/meta.json" "$OUT/corpus_meta.json"; cp "$R/tok/tokens.json" "$OUT/tokens.json"
  (
    [[ $GPU_TESTS == 1 ]] && wait $TESTS
    stamp "GPU 1: head for the shipped target"
    CUDA_VISIBLE_DEVICES=1 timeout 330 $M train-draft --data "$R/tok" --target $SHIPPED --out "$R/head_shipped" \
      $( [[ ${SMOKE:-0} == 1 ]] && echo "" || echo "--time-budget $OLD_HEAD_TIME" ) $H_ARGS > "$R/head_shipped.log" 2>&1
    stamp "GPU 1: done ($?)"
  ) &
  HEAD=$!
  stamp "GPU 0: target"
  CUDA_VISIBLE_DEVICES=0 timeout 360 $M train-target --data "$R/tok" --out "$R/target" $T_ARGS > "$R/target.log" 2>&1
  stamp "GPU 0: target done ($?)"
  wait $HEAD
  d=$(pack_dir s1 "$R/target" "$R/head_shipped")
  cp "$R"/*.log "$d/" 2>/dev/null
  $PY -m m3eagle.training.transport pack "$d" "$OUT"
  stamp "packed"; ls -la "$OUT"
  tail -3 "$R/cuda_graphs.log" 2>/dev/null; tail -2 "$R/target.log"; tail -3 "$R/head_shipped.log"
fi

heads() {  # heads TARGET "GPU:NAME:ARGS" ...: one train-draft per spec, all in parallel, then pack each
  local target=$1 hb spec gpu name args v
  shift
  hb=$( [[ ${SMOKE:-0} == 1 ]] && echo "" || echo "--time-budget $HEAD_TIME" )
  local pids=() names=()
  for spec in "$@"; do
    gpu=${spec%%:*}; name=${spec#*:}; args=${name#*:}; name=${name%%:*}
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$gpu timeout $((HEAD_TIME + 120)) $M train-draft --data "$R/tok" --target "$target" \
      --out "$R/head_$name" $hb $H_ARGS $args > "$R/head_$name.log" 2>&1 &
    pids+=($!); names+=("$name")
    stamp "GPU $gpu: head_$name ($args) started"
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}"; stamp "head_${names[$i]} done ($?)"; done
  for v in "${names[@]}"; do
    local d; d=$(pack_dir "$v" "" "$R/head_$v"); cp "$R/head_$v.log" "$d/"
    mkdir -p "$OUT/$v" && $PY -m m3eagle.training.transport pack "$d" "$OUT/$v"
  done
  stamp "packed"; ls -la "$OUT"/*
  for v in "${names[@]}"; do tail -n 2 "$R/head_$v.log"; done
}

if [[ $STAGE == 2 ]]; then
  if [[ ! -f $R/data.ready ]]; then stamp "cold machine: rebuilding the data"; data || exit 1; fi
  if [[ ! -f $R/target/final/model.safetensors ]]; then
    stamp "cold machine: target from ${TARGET_PARTS:?set TARGET_PARTS}"
    $PY -m m3eagle.training.transport unpack "$TARGET_PARTS" "$R/cold" && mkdir -p "$R/target" && mv "$R/cold/target/final" "$R/target/final"
    cp "$R/tok/tokenizer.json" "$R/target/final/"
  fi
  heads "$R/target/final" "0:plain:" "1:sd:--self-distill-rows $SD_ROWS"
fi

if [[ $STAGE == 3 ]]; then
  [[ -f $R/data.ready ]] || { stamp "data"; data || exit 1; stamp "data ready"; }
  heads $SHIPPED "0:a:${HEAD_A_ARGS:---draft-vocab-size 6144}" "1:b:${HEAD_B_ARGS:---ttt-steps 7 --step-decay 0.9}"
fi

if [[ $STAGE == 4 ]]; then  # HEADS="GPU:NAME:ARGS;GPU:NAME:ARGS;...": any number of head variants for the shipped target
  [[ -f $R/data.ready ]] || { stamp "data"; data || exit 1; stamp "data ready"; }
  IFS=';' read -r -a specs <<< "${HEADS:?set HEADS}"
  heads $SHIPPED "${specs[@]}"
fi
