#!/usr/bin/env bash
# The headline SmolLM2 drafter on one GPU: train the `smollm2-135m` recipe to the end of its
# schedule on the data-at-scale set, evaluate it (GSM8K, MT-Bench, HumanEval; t=0 and t=1;
# CUDA-graph decoding against the target alone, plus plain eager HF decoding at t=0), export
# it to both serving layouts, and write the headline JSON with each goal met or not.
#
#   DATA=benchmarks/out/data_scale/prep_mask bash benchmarks/gpu/headline.sh
#   STEPS=200 SAMPLES=10 DATA=... bash benchmarks/gpu/headline.sh      # a short rehearsal
#
# Resumable: run it again after an interruption and training continues from the run
# directory's latest checkpoint (`dflash train --resume`); finished stages are not redone.
# Inputs: DATA (required): a prepared directory (`dflash data prepare` output); the SmolLM2
#   and eval-set asset packages (docs/assets.md).
# Knobs: RUN (benchmarks/out/headline/run), STEPS (the recipe's schedule when empty),
#   SAMPLES (40 prompts per set), MAX_NEW_TOKENS (256), PUBLISH (drafters/smollm2-135m-dflash-b16),
#   EVALS ("t0 t1 eager": which evaluations, in order; the export comes first),
#   EAGER_SETS, EAGER_SAMPLES (the eager evaluation's sets and prompts per set: plain HF
#   decoding is slow; its baseline rate is what the speedup over eager decoding divides by),
#   T1_ARGS (more flags for the t=1 evaluation, e.g. --no-baseline when the GPU is shared),
#   EXTRA (more training overrides), OUT (benchmarks/out/headline).
# Outputs: $OUT/headline_smollm2_h200.json (what benchmarks/results/ keeps), $OUT/t0, $OUT/t1,
#   $OUT/eager (eval reports), $OUT/zlab and $OUT/speculators (checked exports), $PUBLISH.
# Runtime: training dominates: tokens x epochs / packed tokens per second
#   (benchmarks/small_target_speed_h200_202612.md), then about 10 minutes of evaluation.
# Result document: benchmarks/headline_smollm2_h200_<date>.md
source "$(dirname "$0")/../lib.sh"
DATA="${DATA:?set DATA to a prepared directory}"
OUT="${OUT:-$REPO/benchmarks/out/headline}"
RUN="${RUN:-$OUT/run}"
PUBLISH="${PUBLISH:-$REPO/drafters/smollm2-135m-dflash-b16}"
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"

echo "== train"
steps=()
[ -n "${STEPS:-}" ] && steps=("training.max_steps=$STEPS")
if [ -d "$RUN/drafter" ]; then
  echo "trained: $RUN/drafter"
elif [ -e "$RUN/checkpoints/LATEST" ]; then
  $DFLASH train --resume "$RUN" 2>&1 | tee -a "$OUT/train.log"
else
  $DFLASH train --recipe smollm2-135m "data.train=$DATA" "run.output_dir=$RUN" "${steps[@]}" \
    ${EXTRA:-} 2>&1 | tee "$OUT/train.log"
fi

echo "== export"
for layout in zlab speculators; do
  $DFLASH export "$RUN" --to "$layout" "$OUT/$layout" --force
  $DFLASH export --check "$OUT/$layout"
done
publish() {  # the z-lab export at $PUBLISH, its card naming that path; then the eval reports
  local evals=()
  for e in t0 t1; do [ -e "$OUT/$e/eval.json" ] && evals+=(--eval "$OUT/$e"); done
  mkdir -p "$(dirname "$PUBLISH")"
  (cd "$REPO" && $DFLASH export "$RUN" --to zlab "${PUBLISH#"$REPO"/}" --force "${evals[@]}")
}
publish  # before the evaluations: the weights are in place even if they do not finish

echo "== evaluate"
evaluate() {  # name, temperature, prompt sets, prompts per set, then extra flags
  local name=$1 temp=$2 sets=$3 samples=$4
  shift 4
  [ -e "$OUT/$name/eval.json" ] && return 0
  $DFLASH eval --drafter "$RUN" --prompts "$sets" \
    --max-samples "$samples" --max-new-tokens "${MAX_NEW_TOKENS:-256}" \
    --temperature "$temp" --allow-mismatch --no-progress --out-dir "$OUT/$name" "$@" \
    > "$OUT/$name.log" 2>&1
}
all=gsm8k,mt-bench,humaneval
for e in ${EVALS:-t0 t1 eager}; do
  case $e in
    t0) evaluate t0 0 "$all" "${SAMPLES:-40}" ;;
    t1) evaluate t1 1 "$all" "${SAMPLES:-40}" ${T1_ARGS:-} ;;
    eager) evaluate eager 0 "${EAGER_SETS:-$all}" "${EAGER_SAMPLES:-${SAMPLES:-40}}" --decode eager ;;
    *) echo "unknown evaluation $e" >&2; exit 2 ;;
  esac
done

publish  # again, with the measured acceptance in its card

echo "== report"
for e in t0 t1; do
  [ -e "$OUT/$e/eval.json" ] || { echo "no $e evaluation yet: EVALS=\"t0 t1\" to finish"; exit 0; }
done
eager=()
[ -e "$OUT/eager/eval.json" ] && eager=(--eager "$OUT/eager")
"$PY" benchmarks/headline_report.py --t0 "$OUT/t0" --t1 "$OUT/t1" "${eager[@]}" \
  --drafter "${PUBLISH#"$REPO"/}" --out "$OUT/headline_smollm2_h200.json"
