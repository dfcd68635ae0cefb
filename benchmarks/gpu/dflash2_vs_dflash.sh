#!/usr/bin/env bash
# DFlash against DFlash2 on SmolLM2-135M-Instruct at equal training budget: both kinds continue
# from the same starting drafter on the same prepared set with the same steps, anchors, seed
# and schedule (a DFlash2 drafter starts from the DFlash backbone with its convolutions and
# selector as no-ops), at block 16 and block 8; then all four are served side by side
# (benchmarks/dflash2_vs_dflash.py: one target-only baseline per set and temperature, CUDA
# graphs, GSM8K / MT-Bench both turns / HumanEval, t=0 and t=1).
#
#   bash benchmarks/gpu/dflash2_vs_dflash.sh
#   STAGES="prepare train_b16 eval" STEPS=50 SAMPLES=4 bash benchmarks/gpu/dflash2_vs_dflash.sh
#
# Stages (STAGES, in order; finished ones skipped, a failed one reported and the next run):
#   prepare    the regenerated set (REGEN) tokenized, loop tails masked
#   train_b16  dflash_b16 and dflash2_b16 (dflash2e_b16) from INIT, all at once on the GPU (their
#              throughput is not what this measures)
#   train_b8   dflash_b8 and dflash2_b8 from INIT (block 8, gamma 4), likewise
#   eval       the DFlash2 weights packed, then every trained drafter served side by side
#              (plus dflash_b16 with argmax drafts from its own distribution at t > 0)
# Inputs: REGEN (the target's answers to 10,752 ShareGPT prompts, kept in benchmarks/results),
#   INIT (the published drafter; training waits up to INIT_WAIT seconds for it to appear),
#   the SmolLM2 and eval-set asset packages
#   (benchmarks/offline_bundle.sh carries them to a machine without a registry).
# Knobs: STEPS (300), LR (2e-4), WARMUP (0.1), BUDGET (32768 tokens a step), ANCHORS (2048),
#   SELECTOR_LR_SCALE (1: the DFlash2 selector's lr as a multiple of LR), CODEBOOKS ("tables":
#   the DFlash2 runs' drafter.selector_codebooks; "tables embedding" trains both, the second
#   as dflash2e_b<block>), SERVE (the trained runs to serve; default all), COMPILE_DRAFTER (0;
#   1 serves every drafter with its step compiled, --compile-drafter), DRAFT_SCALES (e.g.
#   "0.65": at t > 0 each served drafter again as <name>_x0.65, its drafts sampled at 0.65 x T),
#   SAMPLES (40),
#   EVAL_NEW_TOKENS (256), TEMPS ("0,1"), SETS (gsm8k,mt-bench,humaneval),
#   CAND_RESPONSES (10 answers walked for the t=0 candidate numbers), GREEDY_DFLASH (1: also
#   dflash_b16_greedy, its argmax drafts at t > 0; the drafters themselves sample there),
#   DEVICE (cuda; cpu rehearses with tiny knobs), OUT (benchmarks/out/dflash2_vs_dflash),
#   RET ($OUT/ret), EVAL_TAG (suffix of the eval stage's name and log: a second eval stage into
#   the same $OUT/eval, e.g. the block-8 drafters after the block-16 ones, adds to its JSON).
# Outputs: $OUT/eval/dflash2_vs_dflash.json and a report per drafter, set and temperature;
#   $OUT/<name>/ the runs; $RET/results.tgz (every JSON, log and plot), $RET/weights-<name>.tgz.part-*
#   (the DFlash2 drafters exported in the z-lab layout, bf16, with their lineage; 15 MB parts: `cat ... | tar xz`).
# Runtime on one H100: prepare 20 s, each training about a minute, eval about 15 minutes.
# Result document: benchmarks/dflash2_vs_dflash_smollm2_<gpu>_<date>.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/dflash2_vs_dflash}"
RET="${RET:-$OUT/ret}"
DEVICE="${DEVICE:-cuda}"
REGEN="${REGEN:-$SHAREGPT_REGEN}"
INIT="${INIT:-$PUBLISHED_DRAFTER}"
mkdir -p "$OUT" "$RET"
source "$REPO/benchmarks/stages.sh"
start_packer
report_env | tee "$OUT/env.txt"

prepare() {
  $DFLASH data prepare --input "$REGEN" --tokenizer asset:smollm2-135m-instruct \
    --out "$OUT/prep" --eval-fraction 0.01 --loop-tails mask --overwrite > "$OUT/prepare.log" 2>&1
}

train_run() {  # name, kind, block[, codebooks]: one continuation from INIT
  local name=$1 kind=$2 block=$3 codebooks=${4:-tables} gamma=7.0
  [ "$block" = 8 ] && gamma=4.0
  [ -d "$OUT/$name/drafter" ] && return 0
  local device=() extra=()
  [ "$DEVICE" = cuda ] || device=(training.device=cpu data.max_doc_tokens=1024)
  [ "$kind" = dflash2 ] && extra=("training.selector_lr_scale=${SELECTOR_LR_SCALE:-1}"
    "drafter.selector_codebooks=$codebooks")
  $DFLASH train --recipe smollm2-135m "data.train=$OUT/prep" "run.output_dir=$OUT/$name" \
    "drafter.init_from=$INIT" "drafter.kind=$kind" "drafter.block_size=$block" \
    "training.gamma=$gamma" "training.max_steps=${STEPS:-300}" "training.lr=${LR:-2e-4}" \
    "training.warmup_ratio=${WARMUP:-0.1}" "data.token_budget=${BUDGET:-32768}" \
    "training.max_anchors=${ANCHORS:-2048}" training.eval_every=0 \
    training.checkpoint_every=100000 training.log_every=25 "${device[@]}" "${extra[@]}" \
    > "$OUT/$name.log" 2>&1
}
pair() {  # the kinds at one block size, side by side on the GPU (their compiles overlap)
  local block=$1 cb pids=() p ok=0
  wait_for_init || return 1
  train_run "dflash_b$block" dflash "$block" &
  pids+=($!)
  for cb in ${CODEBOOKS:-tables}; do
    case $cb in
      tables) train_run "dflash2_b$block" dflash2 "$block" tables & ;;
      embedding) train_run "dflash2e_b$block" dflash2 "$block" embedding & ;;
      *) echo "unknown CODEBOOKS entry $cb" >&2; return 1 ;;
    esac
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || ok=1; done
  return $ok
}
train_b16() { pair 16; }
train_b8() { pair 8; }

wait_for_init() {  # INIT may arrive after the driver started (a later transfer)
  local t=0
  until [ -e "$INIT/model.safetensors" ] || [ -e "$INIT/drafter.safetensors" ]; do
    [ $t -ge "${INIT_WAIT:-600}" ] && { echo "no drafter at INIT=$INIT"; return 1; }
    sleep 5
    t=$((t + 5))
  done
}

eval_all() {
  local args=() name s
  for name in ${SERVE:-dflash_b16 dflash2_b16 dflash2e_b16 dflash_b8 dflash2_b8 dflash2e_b8}; do
    [ -d "$OUT/$name/drafter" ] || continue
    args+=(--drafter "$name=$OUT/$name")
    for s in ${DRAFT_SCALES:-}; do  # t > 0 only: the same drafter, drafts at s x T
      args+=(--also "${name}_x$s=$OUT/$name:auto@$s")
    done
  done
  if [ "${GREEDY_DFLASH:-1}" = 1 ] && [ -d "$OUT/dflash_b16/drafter" ]; then
    args+=(--also "dflash_b16_greedy=$OUT/dflash_b16:greedy")
  fi
  local dev=()
  [ "$DEVICE" = cuda ] || dev=(--device cpu --decode eager)
  [ "${COMPILE_DRAFTER:-0}" = 1 ] && dev+=(--compile-drafter)
  # The weights first: a job whose time ends during the evaluation still brings them back.
  pack_weights dflash2_b16
  pack_weights dflash2e_b16
  "$PY" benchmarks/dflash2_vs_dflash.py "${args[@]}" --sets "${SETS:-gsm8k,mt-bench,humaneval}" \
    --samples "${SAMPLES:-40}" --max-new-tokens "${EVAL_NEW_TOKENS:-256}" \
    --temperatures "${TEMPS:-0,1}" --candidate-responses "${CAND_RESPONSES:-10}" \
    --out "$OUT/eval" "${dev[@]}" > "$OUT/eval${EVAL_TAG:-}.log" 2>&1
}

pack_weights() {  # a run's final drafter exported (z-lab layout, bf16, its lineage with the
  # export's weights hash: what would be published), in parts under 16 MB
  local name=$1 dir="$OUT/weights/$1"
  [ -d "$OUT/$name/drafter" ] || return 0
  rm -rf "$dir"
  mkdir -p "$OUT/weights"
  $DFLASH export "$OUT/$name/drafter" --to zlab "$dir" --dtype bfloat16 > "$OUT/export_$name.log" 2>&1 || return 1
  rm -f "$RET/weights-$name.tgz.part-"*
  tar czf - -C "$OUT/weights" "$name" | split -b 15000000 - "$RET/weights-$name.tgz.part-"
}

for s in ${STAGES:-prepare train_b16 train_b8 eval}; do
  case $s in
    prepare | train_b16 | train_b8) stage "$s" "$s" ;;
    eval) stage "eval${EVAL_TAG:-}" eval_all ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
pack
echo "== all stages ended ($(date -u +%H:%M:%S))"
