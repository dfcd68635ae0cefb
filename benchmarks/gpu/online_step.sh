#!/usr/bin/env bash
# The whole online training step (target forward + drafter step + optimizer) through the real
# Trainer, next to the planner's prediction, on one GPU.
#
#   bash benchmarks/gpu/online_step.sh
#   CASES="smollm2" OUT=/tmp/os bash benchmarks/gpu/online_step.sh
#
# Measures, per case: time to the first finished step, steady step time split into target and
#   drafter stages, samples/s, tokens/s, peak memory, and the planner's prediction of each.
# Cases (CASES, default "qwen3.6-27b smollm2"):
#   qwen3.6-27b        random-weight Qwen3.6-27B target + the 1.7B drafter, 4 docs x 2048 tokens;
#                      with PRECISION=both (the default) the bf16 target, then the FP8 one
#                      (target.precision=fp8), in the same process: target stage, drafter stage,
#                      whole step and peak memory of each, merged into $OUT/fp8_target_<gpu>.json
#                      as {"bf16": {"target_ms", "drafter_ms", "step_ms", "peak_gb"}, "fp8": ...}
#                      (the bf16 leg needs about 100 GB: on an 80 GB card it is recorded as out
#                      of memory and the FP8 leg still runs)
#   smollm2            random-weight SmolLM2-135M target + the 19M recipe drafter, 29 docs of an
#                      8192-token pack, with a profile of the top ops
#   smollm2-unpacked   the same with training.pack_documents=false (one drafter forward per
#                      document: the packing baseline; not in the default list)
# Inputs: none (random weights and random documents; no model download).
# Knobs: CASES, STEPS (20; 5 for the 27B case), PRECISION (both, bf16 or fp8: the 27B case's
#   target legs), OUT (benchmarks/out/online_step).
#   Qwen3.6-27B is much faster with flash-linear-attention installed (`fla`; else pure torch).
# Outputs: $OUT/<case>.json (two legs: $OUT/<case>.bf16.json and .fp8.json), $OUT/<case>.log,
#   $OUT/fp8_target_<gpu>.json (the 27B case's legs; benchmarks/results/ keeps it)
# Runtime: about 3 minutes per target leg of the 27B case, under 2 minutes per SmolLM2 case.
# Result document: benchmarks/online_step_h200_202612.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/online_step}"
STEPS="${STEPS:-20}"
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"
SMOL=(target.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct training.eval_every=0)
for case in ${CASES:-qwen3.6-27b smollm2}; do
  echo "== $case"
  case "$case" in
    qwen3.6-27b) args=(--recipe qwen3.6-27b --docs 4 --steps 5 --target-precision "${PRECISION:-both}" --fp8-json "$OUT") ;;
    smollm2) args=(--recipe smollm2-135m --docs 29 --steps "$STEPS" --profile --override "${SMOL[@]}") ;;
    smollm2-unpacked) args=(--recipe smollm2-135m --docs 29 --steps "$STEPS" --override "${SMOL[@]}" training.pack_documents=false) ;;
    *) echo "unknown case $case" >&2; exit 2 ;;
  esac
  "$PY" benchmarks/online_step.py "${args[@]}" --json "$OUT/$case.json" 2>&1 | tee "$OUT/$case.log" | tail -n 30
done
