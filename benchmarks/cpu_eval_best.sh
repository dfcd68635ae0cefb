#!/usr/bin/env bash
# Evaluate the best H200 drafter (dpace_long, step 1000) on CPU on MT-Bench, HumanEval and
# GSM8K at temperature 0 and 1: the H200 evaluation of these sets never finished (see
# smollm2-135m_h200_202612.md), and the device time for that work is spent.
# Tau is set by the drafter and the target's tokens, not by the hardware; the CPU's
# speedup is its own (fp32, compute-bound verification) and is not the GPU's.
#   bash benchmarks/cpu_eval_best.sh DRAFTER_PARTS_DIR OUT_DIR
# DRAFTER_PARTS_DIR holds best_drafter_bf16.part00..02, spec.json, meta.json and
# whole.sha256 (the drafter is 38.7 MB and is not committed; its sha256 is in the result file).
set -euo pipefail
P=${1:?parts dir}; OUT=${2:?out dir}
D=$(mktemp -d); trap 'rm -rf "$D"' EXIT
cat "$P"/best_drafter_bf16.part0{0,1,2} > "$D/drafter.safetensors"
cp "$P/spec.json" "$P/meta.json" "$D/"
(cd "$D" && sha256sum -c "$P/whole.sha256")
mkdir -p "$OUT"
for t in 0 1; do
  /usr/bin/time -v dflash eval --drafter "$D" --device cpu --prompts mt-bench,humaneval,gsm8k \
    --max-samples 10 --max-new-tokens 128 --temperature $t --out-dir "$OUT/t$t" \
    2> "$OUT/t$t.log.txt"
done
nproc; lscpu | grep "Model name"
