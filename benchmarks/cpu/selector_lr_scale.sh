#!/usr/bin/env bash
# How fast the DFlash2 selector learns at different learning-rate scales when a DFlash2 drafter
# continues from a trained DFlash drafter: same data, seed, steps and batches, only
# training.selector_lr_scale differs. Read the in-batch metrics: the selector path's accuracy
# and tau against the backbone's independent argmax on the same slots.
#
#   bash benchmarks/cpu/selector_lr_scale.sh
#
# Inputs: REGEN (the target's answers, default the ShareGPT set kept in benchmarks/results),
#   INIT (the published DFlash drafter), the SmolLM2 asset package.
# Knobs: SCALES ("1 30"), STEPS (100), BUDGET (1024 tokens a step), ANCHORS (64), LR (2e-4),
#   OUT (benchmarks/out/selector_lr_scale). Both scales run at once, one thread each.
# Outputs: $OUT/s<scale>/metrics.jsonl and $OUT/s<scale>.log, $OUT/summary.json (the last
#   three logged steps of each).
# Runtime: about 8 minutes on 2 cores (4-5 s a step).
# Result document: benchmarks/selector_lr_scale_smollm2_cpu_202612.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/selector_lr_scale}"
REGEN="${REGEN:-$REPO/benchmarks/results/smollm2-135m_sweep_h200_202612/regenerated_sharegpt_smollm2.jsonl.gz}"
INIT="${INIT:-$REPO/drafters/smollm2-135m-dflash-b16}"
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"
[ -d "$OUT/prep" ] || $DFLASH data prepare --input "$REGEN" --tokenizer asset:smollm2-135m-instruct \
  --out "$OUT/prep" --eval-fraction 0.01 --loop-tails mask > "$OUT/prepare.log" 2>&1
pids=()
for s in ${SCALES:-1 30}; do
  OMP_NUM_THREADS=1 $DFLASH train --recipe smollm2-135m "data.train=$OUT/prep" \
    "run.output_dir=$OUT/s$s" --overwrite "drafter.init_from=$INIT" drafter.kind=dflash2 \
    drafter.block_size=16 training.gamma=7.0 "training.max_steps=${STEPS:-100}" \
    "training.lr=${LR:-2e-4}" training.warmup_ratio=0.1 "data.token_budget=${BUDGET:-1024}" \
    "training.max_anchors=${ANCHORS:-64}" training.eval_every=0 \
    training.checkpoint_every=100000 training.log_every=10 training.device=cpu \
    data.max_doc_tokens=1024 "training.selector_lr_scale=$s" > "$OUT/s$s.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
"$PY" - "$OUT" ${SCALES:-1 30} << 'PYEOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
keys = ("accuracy", "selector_accuracy", "exact_tau", "selector_tau", "selector_loss", "base_loss")
summary = {}
for s in sys.argv[2:]:
    rows = [json.loads(line) for line in (out / f"s{s}" / "metrics.jsonl").read_text().splitlines()]
    summary[s] = [{"step": r["step"], **{k: round(r[k], 4) for k in keys}} for r in rows[-3:]]
    for r in summary[s]:
        print(s, r)
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
PYEOF
