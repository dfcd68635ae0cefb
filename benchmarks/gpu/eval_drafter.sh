#!/usr/bin/env bash
# Speculative decoding with a trained drafter against the target alone, on one GPU: tau,
# speedup and the lossless check on GSM8K, MT-Bench and HumanEval.
#
#   DRAFTER=runs/long bash benchmarks/gpu/eval_drafter.sh
#   DRAFTER=export/ TEMPS=0 SAMPLES=20 bash benchmarks/gpu/eval_drafter.sh
#
# Measures: `dflash eval` per prompt set: tau (z-lab convention and pooled), accepted-length
#   histogram, decode speedup over the target alone (same code, same process, CUDA graphs by
#   default), and at temperature 0 the token-for-token comparison with the target's output.
# Inputs: DRAFTER (required): a run directory, a checkpoint directory or an export. The target
#   is the one the drafter records (set TARGET to override). The prompt sets are asset packages
#   (docs/assets.md).
# Knobs: SETS (gsm8k,mt-bench,humaneval), SAMPLES (10 prompts per set), MAX_NEW_TOKENS (256),
#   TEMPS ("0 1"; one after the other, so each speedup has the GPU to itself), SIDE_BY_SIDE
#   (1: the temperatures at once, faster, for tau only: the speedups then share the GPU),
#   DECODE (auto), EXTRA (more `dflash eval` flags, e.g. "--target-dtype float32"),
#   OUT (benchmarks/out/eval_drafter).
# Outputs: $OUT/t<temp>/ (eval.json with every response, eval.md, plots), $OUT/t<temp>.log
# Runtime: about 2-5 minutes for the SmolLM2 drafters with the defaults.
# Result document: benchmarks/smollm2-135m_h200_202612.md
source "$(dirname "$0")/../lib.sh"
DRAFTER="${DRAFTER:?set DRAFTER to a run, checkpoint or export directory}"
OUT="${OUT:-$REPO/benchmarks/out/eval_drafter}"
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"
target=()
[ -n "${TARGET:-}" ] && target=(--target "$TARGET")
evaluate() {  # temperature
  # --allow-mismatch: a bf16 near-tie is reported in eval.json, not treated as a failure.
  $DFLASH eval --drafter "$DRAFTER" "${target[@]}" --prompts "${SETS:-gsm8k,mt-bench,humaneval}" \
    --max-samples "${SAMPLES:-10}" --max-new-tokens "${MAX_NEW_TOKENS:-256}" --temperature "$1" \
    --decode "${DECODE:-auto}" --allow-mismatch --no-progress ${EXTRA:-} --out-dir "$OUT/t$1" \
    > "$OUT/t$1.log" 2>&1
}
pids=()
rc=0
for t in ${TEMPS:-0 1}; do
  if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
    evaluate "$t" &
    pids+=($!)
  else
    evaluate "$t" || rc=1
  fi
done
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for t in ${TEMPS:-0 1}; do grep -h "dflash eval:" "$OUT/t$t.log" || true; done
exit $rc
