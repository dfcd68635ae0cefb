#!/usr/bin/env bash
# H200 session 4, call 1 (no SmolLM2 weights needed): the GPU tests (compiled training and
# the degenerate pair; the speculative loop on CUDA). Carries `.whl` and `.smol/part-aa`
# (copied to /root/dflash for call 2, which must follow within the 30 s warm window).
set -u
mkdir -p /root/dflash && cp .smol/part-aa /root/dflash/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
echo "== gpu tests $(date +%T)"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_trainer.py tests/test_speculative_gpu.py 2>&1 | tee $OUT/gpu_tests.log | tail -15
echo "== done $(date +%T)"
