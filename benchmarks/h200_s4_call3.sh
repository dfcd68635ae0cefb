#!/usr/bin/env bash
# H200 session 4, call 3: the GPU tests; let the detached sweep go on; at 270 s stop the long runs
# (SIGTERM: checkpoint, then their evaluations start); wait for every evaluation; bring
# back logs, metrics, eval reports and the best long run's drafter (bf16, split in parts).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
W=/root/work
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
# The GPU tests (compiled training + degenerate pair, the speculative loop on CUDA) share
# the GPU with the sweep: they check correctness, not speed.
# Then the planner's compiled memory ledger against the SmolLM2 recipe shape (peak memory is
# per process, so the sweep beside it does not change it; its step time here is not a
# measurement of the planner's timing, which session 3 validated alone).
SMOL="target.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct training.eval_every=0"
( TOKENIZERS_PARALLELISM=false timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_trainer.py tests/test_speculative_gpu.py > $W/out/gpu_tests.log 2>&1
  for shape in "29" "8 drafter.num_layers=3 training.max_anchors=256"; do
    set -- $shape; n=$1; shift
    timeout 90 python3 benchmarks/online_step.py --recipe smollm2-135m --docs $n --steps 8 --override $SMOL "$@" --json $W/out/memcheck_smol_${n}docs.json > $W/out/memcheck_smol_${n}docs.log 2>&1
  done ) &
while [ $(( $(date +%s) - T0 )) -lt 270 ] && [ ! -e $W/out/done_main -o ! -e $W/out/done_dpace_long ]; do
  sleep 30; echo "$(el) $(ls $W/out | grep -c done_) done; $(tail -n 1 $W/runs/main/metrics.jsonl | cut -c1-90)"
done
pkill -TERM -f "^python3 -m dflash_trainer.cli train .*runs/(main|dpace_long) " && echo "$(el) SIGTERM sent to the long runs"
while [ $(( $(date +%s) - T0 )) -lt 560 ] && [ $(ls $W/out | grep -c done_) -lt 9 ]; do
  sleep 15; echo "$(el) $(ls $W/out | grep -c done_) done"
done
echo "== gpu tests"; tail -n 15 $W/out/gpu_tests.log
for f in $W/out/memcheck_*.log; do echo "## $f"; tail -n 2 "$f"; done
for f in $W/out/eval_*/eval.md; do echo "## $f"; sed -n 1,12p "$f"; done
tar czf $OUT/call3.tgz -C $W out
python3 - <<'PY'
import json, os, torch
from safetensors.torch import load_file, save_file
W = "/root/work"
def gsm(name):
    try:
        return json.load(open(f"{W}/out/eval_{name}_t0/eval.json"))["sets"]["gsm8k"]["tau"]
    except Exception:
        return -1.0
best = max(("main", "dpace_long"), key=gsm)
ck = f"{W}/runs/{best}/checkpoints"
step = open(f"{ck}/LATEST").read().strip()
sd = {k: v.to(torch.bfloat16) for k, v in load_file(f"{ck}/{step}/drafter.safetensors").items()}
save_file(sd, f"{W}/best_drafter_bf16.safetensors")
os.system(f"cp {ck}/{step}/meta.json $OUT/best_drafter_meta.json; echo best={best} step={step}")
PY
split -b 15000000 -d $W/best_drafter_bf16.safetensors $OUT/best_drafter_bf16.part
ls -la $OUT; echo "== end $(el)"
