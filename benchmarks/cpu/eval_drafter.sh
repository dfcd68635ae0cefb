#!/usr/bin/env bash
# Speculative decoding with a trained drafter against the target alone, on CPU: tau and the
# lossless check on MT-Bench, HumanEval and GSM8K at temperature 0 and 1.
#
#   DRAFTER=path/to/drafter bash benchmarks/cpu/eval_drafter.sh
#
# Tau depends on the drafter and the target's tokens, not on the hardware, so a CPU evaluation
# stands in for a GPU one where tau is concerned (fp32 on CPU also makes the lossless check
# exact). The speedup it reports is the CPU's own: the 16-token verify forward is
# compute-bound there, so it says nothing about a GPU.
# Inputs: DRAFTER (required): a run, checkpoint or export directory; the target it records
#   (TARGET overrides); the SmolLM2 and evaluation-set asset packages (docs/assets.md).
# Knobs: SETS (mt-bench,humaneval,gsm8k), SAMPLES (10), MAX_NEW_TOKENS (128), TEMPS ("0 1", one
#   after another), EXTRA (more `dflash eval` flags), OUT (benchmarks/out/cpu_eval_drafter).
# Outputs: $OUT/t<temp>/ (eval.json with every response, eval.md, plots), $OUT/t<temp>.log.txt
# Runtime: about 18 minutes per temperature for the SmolLM2 drafter on 2 cores.
# Result document: benchmarks/smollm2-135m_h200_202612.md (section "The best drafter on every
#   prompt set, CPU")
source "$(dirname "$0")/../lib.sh"
DRAFTER="${DRAFTER:?set DRAFTER to a run, checkpoint or export directory}"
OUT="${OUT:-$REPO/benchmarks/out/cpu_eval_drafter}"
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"
target=()
[ -n "${TARGET:-}" ] && target=(--target "$TARGET")
timer=()
[ -x /usr/bin/time ] && timer=(/usr/bin/time -v)
for t in ${TEMPS:-0 1}; do
  "${timer[@]}" $DFLASH eval --drafter "$DRAFTER" "${target[@]}" --device cpu \
    --prompts "${SETS:-mt-bench,humaneval,gsm8k}" --max-samples "${SAMPLES:-10}" \
    --max-new-tokens "${MAX_NEW_TOKENS:-128}" --temperature "$t" ${EXTRA:-} --out-dir "$OUT/t$t" \
    2> "$OUT/t$t.log.txt"
done
