#!/usr/bin/env bash
# The FP8 target against the bf16 one on the real SmolLM2-135M-Instruct, on one GPU: the tapped
# hidden states and label tokens (fp8 vs bf16, with bf16 vs fp32 as the noise floor), then two
# drafters trained against each target (same data, steps, seed) and served with each target.
#
#   bash benchmarks/gpu/fp8_target_check.sh
#   STEPS=600 SAMPLES=40 SETS=gsm8k,mt-bench,humaneval bash benchmarks/gpu/fp8_target_check.sh
#   # detached (a job that outlives the shell; poll $OUT/status):
#   setsid nohup bash benchmarks/gpu/fp8_target_check.sh > /tmp/fp8_check.log 2>&1 < /dev/null &
#
# Resumable: run it again after an interruption; finished stages (the saved target, the
# prepared data, each training run, each evaluation) are not redone, a training run continues
# from its latest checkpoint. The results file is merged, never rewritten from scratch, so the
# online-step legs (benchmarks/gpu/online_step.sh, same OUT) and these checks share it.
# Inputs: the SmolLM2 asset (or TARGET), the ShareGPT asset (or DATA: a prepared directory or
#   raw conversations), the eval-set assets (docs/assets.md).
# Knobs: MODE (all | hidden | tau), TARGET (asset:smollm2-135m-instruct), DATA (asset:sharegpt),
#   RECORDS (3000 raw records prepared), DOCS (64 documents compared), STEPS (150 training steps
#   per drafter), SETS (gsm8k,mt-bench), SAMPLES (10 prompts per set), MAX_NEW_TOKENS (128),
#   SEED (0), EXTRA (more training overrides, a.b=v ...), OUT (benchmarks/out/fp8_target_check).
# Outputs: $OUT/fp8_target_<gpu>.json (keys hidden_states, tau, tau_change, tau_settings;
#   benchmarks/results/ keeps it), $OUT/train_{bf16,fp8}/ (runs), $OUT/eval_*/eval.json,
#   $OUT/*.log, $OUT/status (running, then done or failed <exit code>).
# Runtime: under 10 minutes on one H100 with the defaults (save and prepare ~1 min, hidden
#   states seconds, two trainings ~2 min each, four evaluations ~1 min each).
# Result document: benchmarks/fp8_target_<gpu>_<date>.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/fp8_target_check}"
mkdir -p "$OUT"
echo running > "$OUT/status"
trap 'rc=$?; [ $rc = 0 ] && echo done > "$OUT/status" || echo "failed $rc" > "$OUT/status"' EXIT
report_env | tee "$OUT/env.txt"
extra=()
[ -n "${EXTRA:-}" ] && read -r -a extra <<< "$EXTRA"
"$PY" benchmarks/fp8_target_check.py "${MODE:-all}" --out "$OUT" \
  --target "${TARGET:-asset:smollm2-135m-instruct}" --data "${DATA:-asset:sharegpt}" \
  --records "${RECORDS:-3000}" --docs "${DOCS:-64}" --steps "${STEPS:-150}" \
  --sets "${SETS:-gsm8k,mt-bench}" --samples "${SAMPLES:-10}" \
  --max-new-tokens "${MAX_NEW_TOKENS:-128}" --seed "${SEED:-0}" --override "${extra[@]}" \
  2>&1 | tee -a "$OUT/fp8_target_check.log"
