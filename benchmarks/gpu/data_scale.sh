#!/usr/bin/env bash
# Data at scale on one GPU: the SmolLM2 training set built from the decontaminated prompt
# mixture plus prompts the target writes itself, every user turn answered by the target.
#
#   bash benchmarks/gpu/data_scale.sh
#   PROMPTS=mix_prompts.jsonl SYNTH_N=40000 REGEN_SECONDS=0 bash benchmarks/gpu/data_scale.sh
#
# Steps: (1) the mixture's prompts (`dflash data prompts --sources smollm2-mix`, or PROMPTS if
#   given: a file that command wrote); (2) SYNTH_N prompts sampled from the target
#   (`dflash data synthesize`), decontaminated like the mixture (`dflash data prompts` over a
#   one-source YAML); (3) `dflash data regenerate` of both, all turns, on the static engine;
#   (4) `dflash data prepare`; (5) benchmarks/data_scale_report.py -> data_scale.json.
# Inputs: the SmolLM2 asset package; for step 1 the corpora of docs/data-sources.md; the
#   eval sets of docs/assets.md (decontamination).
# Knobs: MODEL (asset:smollm2-135m-instruct), PROMPTS, SYNTH_N (20000), MAX_NEW_TOKENS (512),
#   MAX_CONVERSATION_TOKENS (4096), DEVICE (cuda), REGEN_SECONDS (0 = to the end; at the
#   limit every answered turn is kept and a rerun resumes), SEED (0), OUT
#   (benchmarks/out/data_scale),
#   ENGINE_ARGS (engine settings of both synthesis and regeneration: "--batch-size 1024
#   --compile-decode", the fastest of benchmarks/gpu/regenerate_speed.sh), REGEN_ARGS (more
#   `dflash data regenerate` flags, e.g. --stop-loops: answers that loop end there, about 38%
#   fewer tokens to generate on this target).
# Outputs: $OUT/data_scale.json, $OUT/prompts.jsonl(.sources.json, .decontam.jsonl),
#   $OUT/synth.jsonl(.report.json), $OUT/regen.jsonl, $OUT/prep/, $OUT/prep_mask/ (loop tails
#   masked: the headline's DATA), $OUT/*.log
# Runtime: regeneration dominates: useful tokens / engine tokens per second
#   (benchmarks/small_target_speed_h200_202612.md).
# Result document: benchmarks/data_scale_smollm2_h200_<date>.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/data_scale}"
MODEL="${MODEL:-asset:smollm2-135m-instruct}"
SEED="${SEED:-0}"
DEVICE="${DEVICE:-cuda}"
ENGINE_ARGS="${ENGINE_ARGS:---batch-size 1024 --compile-decode}"
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"
start=$(date +%s)

echo "== prompts"
if [ -n "${PROMPTS:-}" ]; then
  cp "$PROMPTS" "$OUT/prompts.jsonl"
  for side in sources.json decontam.jsonl; do
    [ -e "$PROMPTS.$side" ] && cp "$PROMPTS.$side" "$OUT/prompts.jsonl.$side"
  done
else
  $DFLASH data prompts --sources smollm2-mix --seed "$SEED" --out "$OUT/prompts.jsonl" \
    2>&1 | tee "$OUT/prompts.log"
fi

echo "== synthesize ${SYNTH_N:-20000} prompts"
$DFLASH data synthesize --model "$MODEL" --n "${SYNTH_N:-20000}" --topics math,code,chat,writing \
  --seed "$SEED" --device "$DEVICE" --no-progress --out "$OUT/synth_raw.jsonl" $ENGINE_ARGS 2>&1 | tee "$OUT/synth.log"
printf 'sources:\n  - name: synth\n    path: %s\n    messages: messages\n' "$OUT/synth_raw.jsonl" \
  > "$OUT/synth_source.yaml"
$DFLASH data prompts --sources "$OUT/synth_source.yaml" --seed "$SEED" --out "$OUT/synth.jsonl" \
  2>&1 | tee -a "$OUT/synth.log"

echo "== regenerate (all turns)"
# Interleaved, a line of each in turn: a time-limited run covers both kinds of prompts.
paste -d '\n' "$OUT/prompts.jsonl" "$OUT/synth.jsonl" | sed '/^$/d' > "$OUT/all_prompts.jsonl"
limit=()
[ "${REGEN_SECONDS:-0}" -gt 0 ] && limit=(--time-limit "$REGEN_SECONDS")
$DFLASH data regenerate --input "$OUT/all_prompts.jsonl" --model "$MODEL" \
  --out "$OUT/regen.jsonl" --max-new-tokens "${MAX_NEW_TOKENS:-512}" \
  --max-conversation-tokens "${MAX_CONVERSATION_TOKENS:-4096}" --seed "$SEED" \
  --device "$DEVICE" --no-progress $ENGINE_ARGS ${REGEN_ARGS:-} "${limit[@]}" 2>&1 | tee "$OUT/regen.log"
regen_s=$(($(date +%s) - start))

echo "== prepare"
$DFLASH data prepare --input "$OUT/regen.jsonl" --tokenizer "$MODEL" --out "$OUT/prep" \
  --eval-fraction 0.01 --overwrite 2>&1 | tee "$OUT/prepare.log" | tail -n 30
# What the headline trains on: the same documents, loop tails out of supervision.
$DFLASH data prepare --input "$OUT/regen.jsonl" --tokenizer "$MODEL" --out "$OUT/prep_mask" \
  --eval-fraction 0.01 --overwrite --loop-tails mask 2>&1 | tee "$OUT/prepare_mask.log" | head -n 3

echo "== report"
printf '{"model": "%s", "seed": %s, "seconds_to_regenerated": %s, "hardware": "%s"}\n' \
  "$MODEL" "$SEED" "$regen_s" "$(head -n 1 "$OUT/env.txt")" > "$OUT/extra.json"
"$PY" benchmarks/data_scale_report.py --regen "$OUT/regen.jsonl" \
  --sidecar "$OUT/prompts.jsonl.sources.json" --prepared "$OUT/prep" \
  --synth-report "$OUT/synth_raw.jsonl.report.json" --extra "$OUT/extra.json" \
  --out "$OUT/data_scale.json"
cat "$OUT/data_scale.json"
