#!/usr/bin/env bash
# H200 session 2, call 3: finish the sweep (the main run trains on, the others resume only
# if call 2 stopped them before max_steps), then evaluate every drafter on GSM8K, MT-Bench
# and HumanEval (temperature 0; the main run also at temperature 1), all side by side.
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
W=/root/work
T0=$(date +%s)
bash benchmarks/h200_s2_sweep.sh $W finish 210
echo "== evals done [$(( $(date +%s) - T0 )) s]"
for f in $W/out/eval_*/eval.md; do echo "## $f"; sed -n 3,8p "$f"; done
tar czf $OUT/call3.tgz -C $W out
# The main drafter's weights in bf16, split under the 16 MiB per-file limit.
python3 - <<'PY'
import os, torch
from safetensors.torch import load_file, save_file
W = "/root/work/runs/main/checkpoints"
step = open(f"{W}/LATEST").read().strip()
sd = {k: v.to(torch.bfloat16) for k, v in load_file(f"{W}/{step}/drafter.safetensors").items()}
save_file(sd, "/root/work/main_drafter_bf16.safetensors")
PY
split -b 15000000 -d /root/work/main_drafter_bf16.safetensors $OUT/main_drafter_bf16.part
cp $W/runs/main/checkpoints/$(cat $W/runs/main/checkpoints/LATEST)/meta.json $OUT/main_drafter_meta.json
ls -la $OUT
