#!/usr/bin/env bash
# What more data buys, on one GPU: the `smollm2-135m` recipe trained on nested random subsets of
# one regenerated set (same epochs), each evaluated at t=0; with the headline run as the
# full-size point and its kept checkpoints evaluated on the same sets, one table and one plot of
# served tau against training-set size and against steps.
#
#   REGEN=benchmarks/out/data_scale/regen.jsonl HEADLINE=benchmarks/out/headline \
#     bash benchmarks/gpu/scaling_curve.sh
#
# Resumable: subsets, prepared data, runs (`dflash train --resume`) and evals already done are kept.
# Inputs: REGEN (required): `dflash data regenerate` output; HEADLINE: benchmarks/gpu/headline.sh's
#   OUT (its run/ and t0/ are the full-size point, its run's checkpoints the steps curve; leave
#   unset to plot the subsets only).
# Knobs: SIZES ("4000 12000" conversations: about 10k and 30k assistant turns of the
#   41k-conversation SmolLM2 set; "" for none: the full run's checkpoints only), SEED (0: the
#   shuffle behind the subsets), SAMPLES (40), SETS (gsm8k,mt-bench: the prompt sets each run
#   and checkpoint is evaluated on), MAX_NEW_TOKENS (256), EVAL_ARGS (more `dflash eval` flags,
#   e.g. --no-baseline when tau is all that is wanted), EXTRA (more training overrides),
#   PREPARE_ARGS (more `dflash data prepare` flags, e.g. --loop-tails mask as the full-size run
#   was prepared), GOALS ("gsm8k=4.0 mt-bench=3.0": the sizes the fitted curves predict for
#   these taus), MODEL (asset:smollm2-135m-instruct),
#   OUT (benchmarks/out/scaling_curve).
# Outputs: $OUT/scaling/scaling.{json,md,png}, $OUT/samples.json (records and assistant turns per
#   subset), $OUT/r<N>/ (runs with t0/ eval), $OUT/prep_<N>/, $HEADLINE/steps/<checkpoint>/
# Runtime: the subsets' training (tokens x epochs / packed tokens per second) plus about
#   3 minutes of evaluation per run or checkpoint.
# Result document: benchmarks/headline_smollm2_h200_<date>.md
source "$(dirname "$0")/../lib.sh"
REGEN="${REGEN:?set REGEN to a regenerated JSONL}"
OUT="${OUT:-$REPO/benchmarks/out/scaling_curve}"
MODEL="${MODEL:-asset:smollm2-135m-instruct}"
mkdir -p "$OUT"
SETS="${SETS:-gsm8k,mt-bench}"
evaluate() {  # drafter (run or checkpoint dir), report dir, log
  [ -e "$2/eval.json" ] || $DFLASH eval --drafter "$1" --prompts "$SETS" \
    --max-samples "${SAMPLES:-40}" --max-new-tokens "${MAX_NEW_TOKENS:-256}" --temperature 0 --allow-mismatch \
    --no-progress --out-dir "$2" ${EVAL_ARGS:-} > "$3" 2>&1
}
sizes=(${SIZES-4000 12000})  # SIZES="" for none: the full run's checkpoints only
if [ ${#sizes[@]} -gt 0 ] && [ ! -e "$OUT/samples.json" ]; then
  "$PY" benchmarks/sample_records.py --input "$REGEN" --sizes "${sizes[@]}" \
    --seed "${SEED:-0}" --out "$OUT"
fi
runs=()
for n in "${sizes[@]}"; do
  prep="$OUT/prep_$n" run="$OUT/r$n"
  echo "== $n conversations"
  [ -e "$prep/manifest.json" ] || $DFLASH data prepare --input "$OUT/sample_$n.jsonl" \
    --tokenizer "$MODEL" --eval-fraction 0.01 --out "$prep" ${PREPARE_ARGS:-} | tail -n 3
  if [ -d "$run/drafter" ]; then
    :
  elif [ -e "$run/checkpoints/LATEST" ]; then
    $DFLASH train --resume "$run" > "$OUT/r$n.log" 2>&1
  else
    $DFLASH train --recipe smollm2-135m "data.train=$prep" "run.output_dir=$run" ${EXTRA:-} \
      > "$OUT/r$n.log" 2>&1
  fi
  evaluate "$run" "$run/t0" "$OUT/r$n.eval.log"
  runs+=(--run "$n=$run")
done
steps=()
if [ -n "${HEADLINE:-}" ]; then
  runs+=(--run "all=$HEADLINE/run" --eval-dir "all=$HEADLINE/t0")
  mkdir -p "$HEADLINE/steps"
  last=$(cat "$HEADLINE/run/checkpoints/LATEST" 2>/dev/null || true)
  for ckpt in "$HEADLINE"/run/checkpoints/step_*; do
    name=$(basename "$ckpt")
    [ -d "$ckpt" ] && [ "$name" != "$last" ] || continue  # the last one is the run's t0
    evaluate "$ckpt" "$HEADLINE/steps/$name" "$HEADLINE/steps/$name.log"
  done
  steps=(--step-evals "$HEADLINE/steps")
fi
samples=()
[ -e "$OUT/samples.json" ] && samples=(--samples "$OUT/samples.json")
[ ${#runs[@]} -gt 0 ] || exit 0  # nothing trained yet
goals=()
for g in ${GOALS-gsm8k=4.0 mt-bench=3.0}; do goals+=(--goal "$g"); done
"$PY" benchmarks/scaling_curve.py "${runs[@]}" "${steps[@]}" "${samples[@]}" "${goals[@]}" \
  --out "$OUT/scaling"
