#!/usr/bin/env bash
# What more data buys, on one GPU: the `smollm2-135m` recipe trained on nested subsets of one
# regenerated set (same epochs), each evaluated at t=0; with the headline run as the full-size
# point, one table and one plot of served tau against training-set size and against steps.
#
#   REGEN=benchmarks/out/data_scale/regen.jsonl HEADLINE=benchmarks/out/headline \
#     bash benchmarks/gpu/scaling_curve.sh
#
# Resumable: prepared subsets, runs (`dflash train --resume`) and evals already done are kept.
# Inputs: REGEN (required): `dflash data regenerate` output; HEADLINE: benchmarks/gpu/headline.sh's
#   OUT (its run/ and t0/ are the full-size point; leave unset to plot the subsets only).
# Knobs: SIZES ("10000 30000" conversations, the first N records of REGEN), SAMPLES (40),
#   SETS (gsm8k,mt-bench,humaneval: the prompt sets each subset run is evaluated on),
#   EXTRA (more training overrides), PREPARE_ARGS (more `dflash data prepare` flags, e.g.
#   --loop-tails mask as the full-size run was prepared), MODEL (asset:smollm2-135m-instruct),
#   OUT (benchmarks/out/scaling_curve).
# Outputs: $OUT/scaling/scaling.{json,md,png}, $OUT/r<N>/ (runs with t0/ eval), $OUT/prep_<N>/
# Runtime: the subsets' training (tokens x epochs / packed tokens per second) plus about
#   3 minutes of evaluation each.
# Result document: benchmarks/headline_smollm2_h200_<date>.md
source "$(dirname "$0")/../lib.sh"
REGEN="${REGEN:?set REGEN to a regenerated JSONL}"
OUT="${OUT:-$REPO/benchmarks/out/scaling_curve}"
MODEL="${MODEL:-asset:smollm2-135m-instruct}"
mkdir -p "$OUT"
runs=()
for n in ${SIZES:-10000 30000}; do
  prep="$OUT/prep_$n" run="$OUT/r$n"
  echo "== $n conversations"
  [ -e "$prep/manifest.json" ] || $DFLASH data prepare --input "$REGEN" --tokenizer "$MODEL" \
    --max-records "$n" --eval-fraction 0.01 --out "$prep" ${PREPARE_ARGS:-} | tail -n 3
  if [ -e "$run/LATEST" ]; then
    $DFLASH train --resume "$run" > "$OUT/r$n.log" 2>&1
  else
    $DFLASH train --recipe smollm2-135m "data.train=$prep" "run.output_dir=$run" ${EXTRA:-} \
      > "$OUT/r$n.log" 2>&1
  fi
  [ -e "$run/t0/eval.json" ] || $DFLASH eval --drafter "$run" --prompts "${SETS:-gsm8k,mt-bench,humaneval}" \
    --max-samples "${SAMPLES:-40}" --max-new-tokens 256 --temperature 0 --allow-mismatch \
    --no-progress --out-dir "$run/t0" > "$OUT/r$n.eval.log" 2>&1
  runs+=(--run "$n=$run")
done
if [ -n "${HEADLINE:-}" ]; then
  runs+=(--run "full=$HEADLINE/run" --eval-dir "full=$HEADLINE/t0")
fi
"$PY" benchmarks/scaling_curve.py "${runs[@]}" --out "$OUT/scaling"
