#!/usr/bin/env bash
# How fast the DFlash2 selector learns at different learning-rate scales and codebook
# parameterisations when a DFlash2 drafter continues from a trained DFlash drafter: same data,
# seed, steps and batches, only training.selector_lr_scale and drafter.selector_codebooks
# differ. Read the in-batch metrics: the selector path's accuracy and tau against the
# backbone's independent argmax on the same slots. Within the first epoch every batch is new
# to the drafter, so they measure what the selector learned on text it had not seen.
#
#   bash benchmarks/cpu/selector_lr_scale.sh
#   RUNS="tables:30 embedding:30" STEPS=120 bash benchmarks/cpu/selector_lr_scale.sh
#
# Inputs: REGEN (the target's answers, default the ShareGPT set kept in benchmarks/results),
#   INIT (the published DFlash drafter), the SmolLM2 asset package.
# Knobs: RUNS ("tables:1 tables:30": codebooks:scale pairs), STEPS (100), BUDGET (1024 tokens a
#   step), ANCHORS (64), LR (2e-4), OUT (benchmarks/out/selector_lr_scale). All runs at once,
#   one thread each.
# Outputs: $OUT/<codebooks>_s<scale>/metrics.jsonl and .log, $OUT/summary.json (the last three
#   logged steps of each, and each run's means over its logged steps).
# Runtime: about 8 minutes on 2 cores (4-5 s a step).
# Result document: benchmarks/selector_lr_scale_smollm2_cpu_202612.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/selector_lr_scale}"
REGEN="${REGEN:-$SHAREGPT_REGEN}"
INIT="${INIT:-$PUBLISHED_DRAFTER}"
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"
prepare_sharegpt "$REGEN" "$OUT/prep" "$OUT/prepare.log"
pids=()
names=()
for run in ${RUNS:-tables:1 tables:30}; do
  cb=${run%%:*} s=${run##*:}
  names+=("${cb}_s$s")
  OMP_NUM_THREADS=1 $DFLASH train --recipe smollm2-135m "data.train=$OUT/prep" \
    "run.output_dir=$OUT/${cb}_s$s" --overwrite "drafter.init_from=$INIT" drafter.kind=dflash2 \
    drafter.block_size=16 training.gamma=7.0 "training.max_steps=${STEPS:-100}" \
    "training.lr=${LR:-2e-4}" training.warmup_ratio=0.1 "data.token_budget=${BUDGET:-1024}" \
    "training.max_anchors=${ANCHORS:-64}" training.eval_every=0 \
    training.checkpoint_every=100000 training.log_every=10 training.device=cpu \
    data.max_doc_tokens=1024 "training.selector_lr_scale=$s" "drafter.selector_codebooks=$cb" \
    > "$OUT/${cb}_s$s.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
"$PY" - "$OUT" "${names[@]}" << 'PYEOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
keys = ("accuracy", "selector_accuracy", "exact_tau", "selector_tau", "selector_loss", "base_loss")
summary = {}
for name in sys.argv[2:]:
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    last = [{"step": r["step"], **{k: round(r[k], 4) for k in keys}} for r in rows[-3:]]
    # Means over the second half of the logged steps: single logged batches are noisy.
    half = rows[len(rows) // 2 :]
    mean = {k: round(sum(r[k] for r in half) / len(half), 4) for k in keys}
    summary[name] = {"last": last, "second_half_mean": mean, "steps": [half[0]["step"], half[-1]["step"]]}
    for r in last:
        print(name, r)
    print(name, "second-half mean", mean)
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
PYEOF
