#!/usr/bin/env bash
# H200 session 6, call 3: let the detached sweep go on; stop the long run with SIGTERM at
# STOP_S seconds if it has not finished (checkpoint, then its evaluations start); wait for
# every evaluation; bring back logs, metrics, eval reports and the long run's drafter (bf16,
# in parts).
set -u
W=/root/work; STOP_S=${STOP_S:-300}; END_S=${END_S:-540}
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
status() { echo "$(el) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) done: $(ls $W/out | grep '^done_' | tr '\n' ' ')"; }
while [ $(( $(date +%s) - T0 )) -lt $STOP_S ] && ! grep -q "train rc" $W/out/train_long.log; do
  sleep 20; status; tail -n 1 $W/runs/long/metrics.jsonl | cut -c1-200
done
pkill -TERM -f "cli train .*runs/long " && echo "$(el) SIGTERM sent to the long run"
while [ $(( $(date +%s) - T0 )) -lt $END_S ] && [ $(ls $W/out | grep -c '^done_') -lt 8 ]; do
  sleep 15; status
done
grep -h "dflash eval: .*tau\|LOSSLESS\|rc=" $W/out/eval_*.log
tail -n 3 $W/out/train_long.log
tar czf $OUT/call3.tgz -C $W out
PYTHONPATH=/tmp/site:$PWD/src python3 - <<'PY'
import os, shutil, torch
from safetensors.torch import load_file, save_file
from dflash_trainer.formats.drafter_io import resolve_drafter_dir
d = resolve_drafter_dir("/root/work/runs/long")
sd = {k: v.to(torch.bfloat16) for k, v in load_file(str(d / "drafter.safetensors")).items()}
save_file(sd, "/root/work/long_drafter_bf16.safetensors")
for f in ("spec.json", "meta.json"):
    shutil.copy(d / f, os.environ["OUT"])
print("long run drafter:", d)
PY
split -b 15000000 -d /root/work/long_drafter_bf16.safetensors $OUT/long_drafter_bf16.part
ls -la $OUT; echo "== end $(el)"
