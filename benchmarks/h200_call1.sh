#!/usr/bin/env bash
# H200 session, call 1: GPU tests, the drafter step at the Qwen3.6-27B drafter geometry,
# and the whole online step with a random-weight Qwen3.6-27B target.
# Run from the repo root on the device with `.whl` and `.smol/part-aa` carried.
set -u
mkdir -p /root/dflash && cp .smol/part-aa /root/dflash/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
echo "== gpu tests"; timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_masks.py tests/test_trainer.py 2>&1 | tail -15
echo "== drafter step"; timeout 250 python3 benchmarks/drafter_step.py --recipe qwen3.6-27b --json $OUT/drafter_step.json 2>&1 | grep -v Warning | tail -12
echo "== online step"; timeout 180 python3 benchmarks/online_step.py --recipe qwen3.6-27b --docs 4 --steps 5 --json $OUT/online_step.json 2>&1 | grep -v "Warning\|it/s" | tail -25
