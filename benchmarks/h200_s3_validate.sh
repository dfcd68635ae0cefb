#!/usr/bin/env bash
# H200 session 3: fresh out-of-sample check of the planner calibrated on session 2's
# measurements (timing.py), and the degenerate-pairs GPU test with its full assert.
# Carries `.whl` (flash-linear-attention, fla-core).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
SMOL="target.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct training.eval_every=0"
echo "== gpu test $(date +%T)"
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_trainer.py 2>&1 | grep -E "assert|Error|passed|failed" | cut -c1-600 | tail -6
echo "== smollm2 29 docs (calibration shape) $(date +%T)"
timeout 50 python3 benchmarks/online_step.py --recipe smollm2-135m --docs 29 --steps 12 --override $SMOL --json $OUT/smol29.json 2>&1 | tail -2
echo "== smollm2 3 layers, 8 docs x 1024, 256 anchors (new shape) $(date +%T)"
timeout 50 python3 benchmarks/online_step.py --recipe smollm2-135m --docs 8 --steps 12 --override $SMOL drafter.num_layers=3 training.max_anchors=256 --json $OUT/smol_l3_8docs.json 2>&1 | tail -2
echo "== qwen3.6-27b 8 docs x 1024 (new shape) $(date +%T)"
timeout 130 python3 benchmarks/online_step.py --recipe qwen3.6-27b --docs 8 --steps 4 --json $OUT/q27_8docs.json 2>&1 | tail -2
echo "== done $(date +%T)"
