#!/usr/bin/env bash
# Regeneration on one GPU: batched throughput against per-prompt HF generate, then the target
# answering the ShareGPT first turns itself, then `dflash data prepare` on the result.
#
#   bash benchmarks/gpu/regenerate.sh
#   REGEN_SECONDS=0 JOBS=1 OUT=/data/regen bash benchmarks/gpu/regenerate.sh   # no time limit
#
# Measures: (1) tokens/s of `dflash data regenerate`'s path (length-sorted, left-padded batches)
#   against plain per-prompt `generate`, same process, same prompts; (2) conversations and
#   tokens regenerated in REGEN_SECONDS by JOBS concurrent processes on the GPU.
# Inputs: the SmolLM2-135M-Instruct and ShareGPT asset packages (docs/assets.md).
#   PROMPTS: a prompts JSONL (default: written to $OUT/sharegpt_prompts.jsonl from the
#   ShareGPT asset by benchmarks/sharegpt_prompts.py).
# Knobs: MODEL (asset:smollm2-135m-instruct), JOBS (4), REGEN_SECONDS (210; 0 = run to the end,
#   SIGINT at the limit keeps every finished record), BATCH (384), MAX_NEW_TOKENS (256),
#   THROUGHPUT_PROMPTS (512), BASELINE_PROMPTS (4), OUT (benchmarks/out/regenerate).
# Outputs: $OUT/regen_throughput.json, $OUT/regen.jsonl.gz (the regenerated conversations),
#   $OUT/prep/ (prepared dataset, manifest.json), $OUT/*.log
# Runtime: about 1 minute (throughput) + REGEN_SECONDS + about 1 minute (prepare).
# Result document: benchmarks/regenerate_h200_202612.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/regenerate}"
MODEL="${MODEL:-asset:smollm2-135m-instruct}"
JOBS="${JOBS:-4}"
REGEN_SECONDS="${REGEN_SECONDS:-210}"
mkdir -p "$OUT/work"
report_env | tee "$OUT/env.txt"
PROMPTS="${PROMPTS:-$OUT/sharegpt_prompts.jsonl}"
if [ ! -e "$PROMPTS" ]; then
  "$PY" benchmarks/sharegpt_prompts.py --out "$PROMPTS"
fi
wc -l "$PROMPTS"

echo "== throughput: batched against per-prompt generate"
"$PY" -m dflash_trainer.data.throughput --model "$MODEL" --input "$PROMPTS" \
  --prompts "${THROUGHPUT_PROMPTS:-512}" --baseline-prompts "${BASELINE_PROMPTS:-4}" \
  --batch-size 256 --max-new-tokens 128 --device cuda \
  > "$OUT/regen_throughput.json" 2> "$OUT/regen_throughput.log"
cat "$OUT/regen_throughput.json"

echo "== regenerate: $JOBS processes, limit ${REGEN_SECONDS}s"
limit=()
[ "$REGEN_SECONDS" -gt 0 ] && limit=(timeout -s INT "$REGEN_SECONDS")
split -n "l/$JOBS" -d -a 2 --additional-suffix=.jsonl "$PROMPTS" "$OUT/work/prompts_"
pids=()
for f in "$OUT"/work/prompts_*.jsonl; do
  i=$(basename "$f" .jsonl); i=${i#prompts_}
  "${limit[@]}" $DFLASH data regenerate --input "$f" --model "$MODEL" --out "$OUT/work/regen_$i.jsonl" \
    --max-turns 1 --max-new-tokens "${MAX_NEW_TOKENS:-256}" --batch-size "${BATCH:-384}" \
    --device cuda --no-progress > "$OUT/regen_$i.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || true; done  # a SIGINT-stopped job still wrote its records
cat "$OUT"/work/regen_*.jsonl > "$OUT/work/regen.jsonl"
wc -l "$OUT"/work/regen_*.jsonl

echo "== prepare"
$DFLASH data prepare --input "$OUT/work/regen.jsonl" --tokenizer "$MODEL" --out "$OUT/prep" \
  --eval-fraction 0.02 2>&1 | tee "$OUT/prepare.log" | tail -n 22
gzip -c "$OUT/work/regen.jsonl" > "$OUT/regen.jsonl.gz"
rm -rf "$OUT/work"
