#!/usr/bin/env bash
# Which per-slot training loss serves best at temperature 1: three DFlash continuations of the
# published drafter on the same data, seed, steps and batches that differ only in
# training.loss (ce: cross-entropy to the target's argmax; kl: KL to the target's whole
# distribution; lk: the acceptance-direct loss, 1 - expected accepted length), then each one's
# expected acceptance on held-out documents (benchmarks/draft_temperature_t1.py: at t=1 with
# drafts sampled from the drafter or its argmax, and at t=0), beside the drafter they started
# from. All three weight the slots by the same decay along the block (the recipe's dpace
# weights are defined from cross-entropy confidences, so kl and lk cannot use them).
#
#   bash benchmarks/cpu/training_loss_t1.sh
#   LOSSES="ce kl" STEPS=100 DOCS=119 bash benchmarks/cpu/training_loss_t1.sh
#
# Inputs: REGEN (the target's answers, default the ShareGPT set kept in benchmarks/results),
#   INIT (the published DFlash drafter), the SmolLM2 asset package.
# The target runs in fp32: this CPU build multiplies bf16 matrices without vector units (a
# step takes minutes instead of seconds).
# Knobs: LOSSES ("ce kl lk"), STEPS (40), BUDGET (1024 tokens a step), ANCHORS (64), LR (2e-4),
#   DOCS (60 of the 119 held-out documents), OUT (benchmarks/out/training_loss_t1). The runs train at
#   once, one thread each.
# Outputs: $OUT/<loss>/ the runs and their logs, $OUT/<name>_heldout.json per drafter,
#   $OUT/summary.json (each drafter's expected tau at t=0 and t=1, and its ratio to the
#   starting drafter's on the same blocks).
# Runtime on 2 cores: about 25 minutes of training (three runs at once, 35 s a step) and 5
# minutes per held-out measurement.
# Result document: benchmarks/training_loss_t1_smollm2_cpu_<date>.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/training_loss_t1}"
REGEN="${REGEN:-$SHAREGPT_REGEN}"
INIT="${INIT:-$PUBLISHED_DRAFTER}"
LOSSES="${LOSSES:-ce kl lk}"
for loss in $LOSSES; do  # each names a run directory under OUT, too
  case $loss in ce | kl | lk) ;; *) echo "LOSSES: $loss is not ce, kl or lk" >&2; exit 2 ;; esac
done
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"
prepare_sharegpt "$REGEN" "$OUT/prep" "$OUT/prepare.log" \
  || { echo "preparing $REGEN failed: see $OUT/prepare.log" >&2; exit 1; }
pids=()
for loss in $LOSSES; do
  OMP_NUM_THREADS=1 $DFLASH train --recipe smollm2-135m "data.train=$OUT/prep" \
    "run.output_dir=$OUT/$loss" --overwrite "drafter.init_from=$INIT" drafter.kind=dflash \
    drafter.block_size=16 training.gamma=7.0 "training.loss=$loss" training.weighting=decay \
    "training.max_steps=${STEPS:-40}" "training.lr=${LR:-2e-4}" training.warmup_ratio=0.1 \
    "data.token_budget=${BUDGET:-1024}" "training.max_anchors=${ANCHORS:-64}" \
    training.eval_every=0 training.checkpoint_every=100000 training.log_every=10 \
    training.device=cpu data.max_doc_tokens=1024 target.dtype=float32 > "$OUT/$loss.log" 2>&1 &
  pids+=($!)
done
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done
[ $failed = 0 ] || { echo "a training run failed: see the logs $OUT/<loss>.log" >&2; exit 1; }
heldout() {  # name, drafter: expected acceptance on the held-out documents (same blocks for all)
  "$PY" benchmarks/draft_temperature_t1.py --drafter "$2" --data "$OUT/prep" \
    --docs "${DOCS:-60}" --temperatures 1 > "$OUT/$1_heldout.json" 2> "$OUT/$1_heldout.log" \
    || { echo "measuring $1 failed: see $OUT/$1_heldout.log" >&2; exit 1; }
}
heldout start "$INIT"
for loss in $LOSSES; do heldout "$loss" "$OUT/$loss"; done
"$PY" - "$OUT" start $LOSSES << 'PYEOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = {n: json.loads((out / f"{n}_heldout.json").read_text()) for n in sys.argv[2:]}
keys = ("t0", "greedy_drafts", "sampled_T1")


def means(r):
    e = r["expected_tau_t1"]
    return {"t0": r["expected_tau_t0"]["mean"], "greedy_drafts": e["greedy_drafts"]["mean"],
            "sampled_T1": e["sampled_T1"]["mean"]}


start = means(rows["start"])
summary = {}
for name, r in rows.items():
    m = means(r)
    summary[name] = {"expected_tau": {k: round(m[k], 4) for k in keys},
                     "over_start": {k: round(m[k] / start[k] - 1, 4) for k in keys},
                     "blocks": r["blocks"]}
    print(name, json.dumps(summary[name]))
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
PYEOF
