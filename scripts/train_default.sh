#!/usr/bin/env bash
# Reproduce m3eagle's embedded default model (m3eagle/assets/default) with the project's own pipeline.
#
#   bash scripts/train_default.sh data      # CPU: corpus + tokenizer + token arrays -> $DATA   (~2 min on 16 cores)
#   bash scripts/train_default.sh gpu       # one GPU: train-target + train-draft -> $RUN        (~9.5 min)
#   bash scripts/train_default.sh install   # copy $RUN's finals into the package, then `eval`
#   bash scripts/train_default.sh all       # the three in a row
#
# The shipped pair was trained with these defaults on a host of 2 x H200 by scripts/train_pair_multi_gpu.sh
# (corpus built there from that machine's site-packages; 1984 target steps and 3404 head steps; set
# TARGET_STEPS=1984 DRAFT_STEPS=3404 to replay that schedule on any machine). Run `data` on the machine that trains: the corpus is its site-packages.
# Progress bars go to stderr; losses go to $RUN/{target,draft}/log.jsonl.
set -euo pipefail
STAGE=${1:-all}
DATA=${DATA:-runs/data}
RUN=${RUN:-runs/default}
TARGET_TIME=${TARGET_TIME:-240}
DRAFT_TIME=${DRAFT_TIME:-300}
TARGET_BUDGET=${TARGET_STEPS:+--steps $TARGET_STEPS}
DRAFT_BUDGET=${DRAFT_STEPS:+--steps $DRAFT_STEPS}
TARGET_ARGS=${TARGET_ARGS:-}
DRAFT_ARGS=${DRAFT_ARGS:-}
PY=${PYTHON:-python3}
M="$PY -m m3eagle.training"

if [[ $STAGE == data || $STAGE == all ]]; then
  $M corpus --out "$DATA/corpus"
  # The shipped BPE is reused (ids and vocabulary stay those of the shipped pair); delete it to learn a new one.
  mkdir -p "$DATA/tok" && cp -n m3eagle/assets/default/target/tokenizer.json "$DATA/tok/"
  $M tokenizer --corpus "$DATA/corpus" --out "$DATA/tok"
fi
if [[ $STAGE == gpu || $STAGE == all ]]; then
  $M train-target --data "$DATA/tok" --out "$RUN/target" ${TARGET_BUDGET:---time-budget $TARGET_TIME} \
     --log-every 50 --eval-every 500 --save-every 1000 $TARGET_ARGS
  $M train-draft --data "$DATA/tok" --target "$RUN/target/final" --out "$RUN/draft" \
     ${DRAFT_BUDGET:---time-budget $DRAFT_TIME} --log-every 50 --eval-every 400 --save-every 1000 --simulate 48 $DRAFT_ARGS
fi
if [[ $STAGE == install || $STAGE == all ]]; then
  cp "$DATA/tok/tokenizer.json" "$DATA/tok/tokenizer_config.json" "$RUN/target/final/"
  $PY -c "from m3eagle.training.cli import install_assets; install_assets('$RUN/target/final', '$RUN/draft/final')"
  $M eval --output "$RUN/eval.json"
fi
