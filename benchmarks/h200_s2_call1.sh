#!/usr/bin/env bash
# H200 session 2, call 1 (no SmolLM2 weights needed): the degenerate-pairs GPU test,
# the SmolLM2-135M online step with a random-weight target of the same shape (planner
# check, with a profile of where the time goes), an out-of-sample variant (1 drafter
# layer, 16k-token packs), and the Qwen3.6-27B online step with compiled drafter layers.
# Carries `.whl` and `.smol/part-aa` (copied to /root/dflash for call 2).
set -u
mkdir -p /root/dflash && cp .smol/part-aa /root/dflash/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
SMOL="target.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct training.eval_every=0"
echo "== gpu test $(date +%T)"
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_trainer.py 2>&1 | tail -4
echo "== smollm2 online $(date +%T)"
timeout 110 python3 benchmarks/online_step.py --recipe smollm2-135m --docs 29 --steps 20 --profile --override $SMOL --json $OUT/smol_online.json 2>&1 | grep -v "Warn\|it/s\|^ *\"\|^ *[0-9, ]*$\|^ *\]\|^ *}" | tail -75
echo "== smollm2 1 layer 16k $(date +%T)"
timeout 80 python3 benchmarks/online_step.py --recipe smollm2-135m --docs 58 --steps 12 --override $SMOL drafter.num_layers=1 data.token_budget=16384 training.max_anchors=1024 --json $OUT/smol_online_l1_16k.json 2>&1 | tail -1
echo "== qwen3.6-27b online $(date +%T)"
timeout 200 python3 benchmarks/online_step.py --recipe qwen3.6-27b --docs 4 --steps 5 --json $OUT/online_27b.json 2>&1 | tail -1
echo "== done $(date +%T)"
