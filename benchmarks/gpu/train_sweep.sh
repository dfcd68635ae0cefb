#!/usr/bin/env bash
# The SmolLM2-135M recipe sweep on one GPU: seven short training runs (the recipe, then one
# change each) and one long run, every drafter then evaluated by speculative decoding.
#
#   bash benchmarks/gpu/train_sweep.sh
#   RUNS="base dpace" STEPS=400 OUT=/tmp/sweep bash benchmarks/gpu/train_sweep.sh
#
# Measures: per run, the training log (loss, exact in-batch tau, per-slot accuracy, tokens/s)
#   and `dflash eval` on GSM8K, MT-Bench and HumanEval at temperature 0 (tau, speedup, lossless
#   check); the long run also at temperature 1, with an fp32 target (the lossless check without
#   bf16 near-ties) and with eager HF decoding on 5 GSM8K prompts (speedup against plain HF
#   decoding). Then a Markdown table and plots (benchmarks/sweep_table.py).
# Runs (RUNS, default all): base = the smollm2-135m recipe (5 layers, block 16, ce, decay gamma 7,
#   noise 0.05); block8; layers1; layers3; kl; dpace; nonoise; long = the recipe with dpace
#   weighting and a cosine schedule over LONG_STEPS, with in-training evaluation.
# Inputs: the SmolLM2 and evaluation-set asset packages (docs/assets.md) and training data:
#   PREP, a `dflash data prepare` directory, or else REGEN, regenerated conversations (JSONL or
#   .jsonl.gz) prepared here (default: the 10,752 conversations committed under
#   benchmarks/results/smollm2-135m_sweep_h200_202612/; make new ones with gpu/regenerate.sh).
# Knobs: STEPS (800), LONG_STEPS (3000), TRAIN_SECONDS (0 = none; else each training run gets
#   SIGTERM at that limit, which saves a checkpoint, and is evaluated from it), SAMPLES (10
#   prompts per set; 20 for the long run), MAX_NEW_TOKENS (256), PARALLEL (1: every run trains
#   side by side on the GPU, each process needs about 3 GB; 0: one after another), EVAL_EXTRA
#   (flags added to every evaluation, e.g. "--decode eager"),
#   OUT (benchmarks/out/train_sweep).
# Outputs: $OUT/metrics_<run>.jsonl, $OUT/train_<run>.log, $OUT/eval_<tag>/ (eval.json, eval.md,
#   plots), $OUT/eval_<tag>.log, $OUT/table.md, $OUT/plots/, $OUT/runs/<run>/ (checkpoints).
# Runtime: side by side on an H200, about 15 minutes for the 800-step runs and their
#   evaluations; the long run takes about 7 minutes more once it has the GPU to itself.
# Result document: benchmarks/smollm2-135m_h200_202612.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/train_sweep}"
STEPS="${STEPS:-800}"
LONG_STEPS="${LONG_STEPS:-3000}"
SAMPLES="${SAMPLES:-10}"
TOKENS="${MAX_NEW_TOKENS:-256}"
SETS=gsm8k,mt-bench,humaneval
mkdir -p "$OUT/runs"
report_env | tee "$OUT/env.txt"

PREP="${PREP:-}"
if [ -z "$PREP" ]; then
  REGEN="${REGEN:-$SHAREGPT_REGEN}"
  PREP="$OUT/prep"
  if [ ! -e "$PREP/manifest.json" ]; then
    case "$REGEN" in
      *.gz) gunzip -c "$REGEN" > "$OUT/regen.jsonl" ;;
      *) cp "$REGEN" "$OUT/regen.jsonl" ;;
    esac
    $DFLASH data prepare --input "$OUT/regen.jsonl" --tokenizer asset:smollm2-135m-instruct \
      --out "$PREP" --eval-fraction 0.02 > "$OUT/prepare.log" 2>&1
    rm -f "$OUT/regen.jsonl"
    tail -n 3 "$OUT/prepare.log"
  fi
fi

COMMON="data.train=$PREP training.log_every=25 training.warmup_ratio=0.03 training.checkpoint_every=500"
declare -A OVERRIDES=(
  [base]=""
  [block8]="drafter.block_size=8 training.gamma=4.0"
  [layers1]="drafter.num_layers=1"
  [layers3]="drafter.num_layers=3"
  [kl]="training.loss=kl"
  [dpace]="training.weighting=dpace"
  [nonoise]="training.noise_std=0"
  [long]="training.weighting=dpace training.eval_every=1200 eval.train_eval_samples=4 eval.max_new_tokens=96 eval.train_walk_docs=8"
)

ev() {  # run tag eval-args...
  local run=$1 tag=$2; shift 2
  $DFLASH eval --drafter "$OUT/runs/$run" --out-dir "$OUT/eval_$tag" --no-progress "$@" ${EVAL_EXTRA:-} \
    > "$OUT/eval_$tag.log" 2>&1
  echo "eval rc=$?" >> "$OUT/eval_$tag.log"
}

one_run() {
  local name=$1 steps=$STEPS limit=()
  [ "$name" = long ] && steps=$LONG_STEPS
  [ "${TRAIN_SECONDS:-0}" -gt 0 ] && limit=(timeout -s TERM "$TRAIN_SECONDS")
  "${limit[@]}" $DFLASH train --recipe smollm2-135m $COMMON training.max_steps="$steps" \
    ${OVERRIDES[$name]} run.output_dir="$OUT/runs/$name" --skip-doctor >> "$OUT/train_$name.log" 2>&1
  echo "train rc=$?" >> "$OUT/train_$name.log"
  cp "$OUT/runs/$name/metrics.jsonl" "$OUT/metrics_$name.jsonl"
  if [ "$name" = long ]; then
    local n=$((2 * SAMPLES))
    # Temperature 0 in bf16 alone first (the speed measurement), then the other three together.
    ev long long_t0 --prompts $SETS --max-samples $n --max-new-tokens "$TOKENS" --temperature 0 --allow-mismatch
    ev long long_t1 --prompts $SETS --max-samples $n --max-new-tokens "$TOKENS" --temperature 1 &
    ev long long_fp32_t0 --prompts $SETS --max-samples $n --max-new-tokens "$TOKENS" --temperature 0 --target-dtype float32 &
    ev long long_eager_t0 --prompts gsm8k --max-samples 5 --max-new-tokens 128 --temperature 0 --decode eager --allow-mismatch &
    wait
  else
    ev "$name" "$name" --prompts $SETS --max-samples "$SAMPLES" --max-new-tokens "$TOKENS" --temperature 0 --allow-mismatch
  fi
}

set +e  # a failed run or evaluation is logged; the others go on
for name in ${RUNS:-long base block8 layers1 layers3 kl dpace nonoise}; do
  [ -n "${OVERRIDES[$name]+x}" ] || { echo "unknown run $name" >&2; exit 2; }
  if [ "${PARALLEL:-1}" = 1 ]; then one_run "$name" & else one_run "$name"; fi
done
wait
set -e
grep -h "dflash eval:" "$OUT"/eval_*.log || true
"$PY" benchmarks/sweep_table.py "$OUT" --plots "$OUT/plots" | tee "$OUT/table.md"
