#!/usr/bin/env bash
# The planner's predicted step time and peak memory against measured ones, on one GPU.
#
#   bash benchmarks/gpu/planner_validation.sh
#
# Measures: the online step (benchmarks/online_step.py, the real Trainer, compiled) at three
#   shapes, each next to `dflash plan`'s prediction for the same config:
#   smol29     SmolLM2-135M recipe, 29 docs per 8192-token pack (the shape the timing model
#              was calibrated on)
#   smol_l3    SmolLM2-135M, 3 drafter layers, 8 docs x 1024 tokens, 256 anchors (not used
#              for calibration)
#   q27_8docs  Qwen3.6-27B random-weight target + 1.7B drafter, 8 docs x 1024 (not used for
#              calibration)
#   The planner's hardware entry is the H200: on another GPU compare the measured numbers only,
#   or calibrate (`dflash plan --calibrate RUN_DIR`).
# Inputs: none (random weights and random documents).
# Knobs: SHAPES (default "smol29 smol_l3 q27_8docs"), STEPS (12; 4 for the 27B shape),
#   OUT (benchmarks/out/planner_validation).
# Outputs: $OUT/planner_validate_<shape>.json (measured and predicted), $OUT/<shape>.log
# Runtime: about 1 minute per SmolLM2 shape, 2-3 minutes for the 27B shape (about 95 GB).
# Result document: benchmarks/planner_validation_h200_202612.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/planner_validation}"
STEPS="${STEPS:-12}"
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"
SMOL=(target.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct training.eval_every=0)
for shape in ${SHAPES:-smol29 smol_l3 q27_8docs}; do
  echo "== $shape"
  case "$shape" in
    smol29) args=(--recipe smollm2-135m --docs 29 --steps "$STEPS" --override "${SMOL[@]}") ;;
    smol_l3) args=(--recipe smollm2-135m --docs 8 --steps "$STEPS" --override "${SMOL[@]}" drafter.num_layers=3 training.max_anchors=256) ;;
    q27_8docs) args=(--recipe qwen3.6-27b --docs 8 --steps 4) ;;
    *) echo "unknown shape $shape" >&2; exit 2 ;;
  esac
  "$PY" benchmarks/online_step.py "${args[@]}" --json "$OUT/planner_validate_$shape.json" \
    2>&1 | tee "$OUT/$shape.log" | tail -n 3
done
