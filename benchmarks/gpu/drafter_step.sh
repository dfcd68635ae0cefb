#!/usr/bin/env bash
# Drafter training step at a real drafter geometry, four ways, on one GPU.
#
#   bash benchmarks/gpu/drafter_step.sh                      # the Qwen3.6-27B drafter (1.7B)
#   RECIPE=qwen3-8b OUT=/tmp/ds bash benchmarks/gpu/drafter_step.sh
#
# Measures: time to the first step (compile included), median step time (forward + loss +
#   backward, optimizer excluded), model TFLOP/s against the bf16 matmul rate measured in the
#   same process, and peak memory, for the compiled path (with and without compiled layers),
#   eager FlexAttention (unfused), and one dense-mask forward per document (no packing).
# Inputs: none. Random weights at the recipe's geometry; an 8192-token pack of 4 documents,
#   512 anchors x 16.
# Knobs: RECIPE (qwen3.6-27b), ITERS (10), VARIANTS (all four), OUT (benchmarks/out/drafter_step).
# Outputs: $OUT/drafter_step.json and a table on stdout.
# Runtime: about 2-4 minutes on an H200 (mostly compilation); needs about 35 GB, and about
#   140 GB for the eager-flex variant (drop it with VARIANTS=compiled,compiled+layers,naive).
# Result document: benchmarks/drafter_step_h200_202612.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/drafter_step}"
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"
"$PY" benchmarks/drafter_step.py --recipe "${RECIPE:-qwen3.6-27b}" --iters "${ITERS:-10}" \
  --variants "${VARIANTS:-compiled,compiled+layers,naive,eager-flex}" --json "$OUT/drafter_step.json"
