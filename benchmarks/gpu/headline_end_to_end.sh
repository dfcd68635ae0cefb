#!/usr/bin/env bash
# The headline SmolLM2 drafter from prompts to published weights on one GPU machine, in stages,
# each one's results packed as soon as it ends, so that a machine lost midway still leaves
# what was finished (`$RET`, polled while it runs):
#   gpu_tests the GPU-marked tests of the fast step and the regeneration engine
#   published the drafter already published at $PUBLISH, evaluated as the headline is (t=0 and
#             t=1 one after the other, each against the target alone; eager HF decoding on
#             GSM8K) with its headline JSON: needs no data and no training
#   speed     regeneration speed, engine variants against HF `generate` (gpu/regenerate_speed.sh)
#   data      the data-at-scale set with the loop stop: synthesis, every turn regenerated,
#             prepared with loop tails masked (gpu/data_scale.sh, REGEN_ARGS=--stop-loops)
#   train_speed  the standard step, the fast step and the fast step with FlexAttention in the
#             target, on the prepared set (train_speed.py --flex-target); the full run takes
#             the flex target when it measured faster
#   scaling   the training-set-size points: nested subsets, same epochs (gpu/scaling_curve.sh)
#   headline  the full run: training, export, t=0 evaluation (gpu/headline.sh, EVALS=t0)
#   steps     the full run's kept checkpoints served at t=0 (the steps curve), then the table
#   block8    the same run at block size 8 (same data, steps and anchors), served at t=0 against
#             the target alone: the second row, which the headline takes only if it wins
#   finish    t=1 and eager HF evaluations, the headline report, the published drafter
#
#   PROMPTS=prompts.jsonl bash benchmarks/gpu/headline_end_to_end.sh
#   STAGES="gpu_tests speed data train_speed headline" PROMPTS=... \
#     bash benchmarks/gpu/headline_end_to_end.sh
#
# Resumable like the scripts it drives: finished stages (a `done_<stage>` marker) are skipped,
# an interrupted training resumes from its latest checkpoint.
# Inputs: PROMPTS: `dflash data prompts --sources smollm2-mix` output (made on any machine that
#   has the corpora; empty: made here); the SmolLM2 and eval-set asset packages
#   (benchmarks/offline_bundle.sh carries both to a machine without a registry).
# Knobs: STAGES ("data headline steps scaling finish"), SPEED_VARIANTS ("rows1024_compiled
#   rows1024_flex rows1024_all": the published setting first, then the new ones), ENGINE_ARGS
#   (the data stage's engine; default: the fastest speed variant measured in $OUT/speed, else
#   "--batch-size 1024 --compile-decode" with cuDNN attention),
#   REGEN_SECONDS (900), SYNTH_N (10000), REGEN_NEW_TOKENS (512), SIZES ("4000 12000"),
#   SAMPLES (40), EVAL_NEW_TOKENS (256), EXTRA (the subsets' training overrides),
#   HEADLINE_EXTRA (the full run's), STEPS (the full run's steps; empty: the recipe's 6
#   epochs), DEVICE (cuda; cpu rehearses the flow with tiny knobs), OUT
#   (benchmarks/out/headline_end_to_end), RET ($OUT/ret).
# Outputs: $OUT/{speed,data,train_speed,scaling,headline}/ as the driven scripts write them;
#   $RET holds at most 8 files: results.tgz (every JSON, Markdown, plot and log, no data or
#   weights), drafter.tgz.part-* (the trained drafter in 15 MB parts: `cat drafter.tgz.part-*
#   | tar xz`).
# Runtime on one H200: gpu_tests ~2 min, published ~12 min, speed ~8 min, data ~12 min
#   (synthesis 2, regeneration ~9 with the loop stop, preparation 1), train_speed ~5 min,
#   scaling ~8 min, headline training ~8 min + 3 min t=0, steps ~1 min a checkpoint, block8
#   ~11 min, finish ~15 min (t=1 with its baseline, eager HF decoding).
# Result document: benchmarks/headline_smollm2_h200_<date>.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/headline_end_to_end}"
RET="${RET:-$OUT/ret}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT" "$RET"
EVAL_NEW_TOKENS="${EVAL_NEW_TOKENS:-256}"
export SAMPLES="${SAMPLES:-40}"

source "$REPO/benchmarks/stages.sh"
start_packer

prompts() {  # the prompts file the speed and data stages read
  if [ -n "${PROMPTS:-}" ]; then
    echo "$PROMPTS"
  else
    [ -e "$OUT/prompts.jsonl" ] || $DFLASH data prompts --sources smollm2-mix --seed 0 \
      --out "$OUT/prompts.jsonl" > "$OUT/prompts.log" 2>&1
    echo "$OUT/prompts.jsonl"
  fi
}

# Each stage is a function whose status is its last command's: `stage` calls it inside `if`,
# where `set -e` does not reach, so its steps are chained with && on purpose.
speed() {
  local prompts
  prompts="$(prompts)" && PROMPTS="$prompts" OUT="$OUT/speed" \
    VARIANTS="${SPEED_VARIANTS:-rows1024_compiled rows1024_flex rows1024_all}" \
    ENGINE_ARGS="--decode-sdpa cudnn --prefill-sdpa cudnn --warm-pass" \
    bash benchmarks/gpu/regenerate_speed.sh
}

engine_args() {  # the fastest measured variant's engine flags (warm pass), else the default
  "$PY" - "$OUT/speed" << 'EOF'
import json
import sys
from pathlib import Path

# The speed stage measures each variant with cuDNN attention kernels: the same here.
base = "--batch-size 1024 --compile-decode --decode-sdpa cudnn --prefill-sdpa cudnn"
flags = {
    "rows1024_compiled": base,
    "rows1024_flex": base + " --decode-attention flex",
    "rows1024_all": base + " --decode-attention flex --compile-prefill",
}
best, rate = flags["rows1024_compiled"], 0.0
for name, f in flags.items():
    p = Path(sys.argv[1]) / f"{name}.json"
    if p.exists():
        d = json.loads(p.read_text())
        r = (d.get("engine_warm_pass") or {}).get("tokens_per_s") or d["engine_tokens_per_s"]
        if r > rate:
            best, rate = f, r
print(best)
EOF
}

data() {
  local prompts args="${ENGINE_ARGS:-}"
  [ -n "$args" ] || args="$(engine_args)"
  [ "$DEVICE" = cuda ] || args="--batch-size 4"
  echo "engine: $args"
  prompts="$(prompts)" && PROMPTS="$prompts" OUT="$OUT/data" ENGINE_ARGS="$args" \
    REGEN_ARGS="--stop-loops" REGEN_SECONDS="${REGEN_SECONDS:-900}" \
    SYNTH_N="${SYNTH_N:-10000}" MAX_NEW_TOKENS="${REGEN_NEW_TOKENS:-512}" DEVICE="$DEVICE" \
    bash benchmarks/gpu/data_scale.sh
}

curve() {  # sizes ("" for none): the subsets, then the full run and its checkpoints (after its t0)
  local head=""
  [ -e "$OUT/headline/t0/eval.json" ] && head="$OUT/headline"
  REGEN="$OUT/data/regen.jsonl" OUT="$OUT/scaling" SIZES="$1" HEADLINE="$head" \
    PREPARE_ARGS="--loop-tails mask" EVAL_ARGS="--no-baseline ${EVAL_ARGS:-}" \
    MAX_NEW_TOKENS="$EVAL_NEW_TOKENS" bash benchmarks/gpu/scaling_curve.sh
}
scaling() { curve "${SIZES:-4000 12000}"; }
steps() {  # the full run's checkpoints; the subsets' rows too once they are done
  [ -e "$OUT/headline/t0/eval.json" ] || { echo "no full run served at t=0 yet"; return 1; }
  if [ -e "$OUT/done_scaling" ]; then curve "${SIZES:-4000 12000}"; else curve ""; fi
}

published() {  # the export's card names its target; eval reads it from the installed asset
  local pub="${PUBLISH:-$REPO/drafters/smollm2-135m-dflash-b16}" dir="$OUT/published"
  for t in 0 1; do
    [ -e "$dir/t$t/eval.json" ] || DRAFTER="$pub" OUT="$dir" TEMPS=$t SAMPLES="$SAMPLES" \
      MAX_NEW_TOKENS="$EVAL_NEW_TOKENS" bash benchmarks/gpu/eval_drafter.sh || return 1
  done
  [ -e "$dir/eager/eval.json" ] || $DFLASH eval --drafter "$pub" --prompts gsm8k \
    --max-samples "${EAGER_SAMPLES:-10}" --max-new-tokens "$EVAL_NEW_TOKENS" --temperature 0 \
    --decode eager --allow-mismatch --no-progress --out-dir "$dir/eager" > "$dir/eager.log" 2>&1 \
    && "$PY" benchmarks/headline_report.py --t0 "$dir/t0" --t1 "$dir/t1" --eager "$dir/eager" \
      --drafter "${pub#"$REPO"/}" --out "$dir/headline_smollm2_h200.json"
}

gpu_tests() {
  "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_fast_step_gpu.py \
    tests/test_regen_engine_gpu.py > "$OUT/gpu_tests.log" 2>&1
  local rc=$?
  tail -n 5 "$OUT/gpu_tests.log"
  return $rc
}

train_speed() {
  mkdir -p "$OUT/train_speed" && "$PY" benchmarks/train_speed.py --data "$OUT/data/prep_mask" \
    --flex-target --out "$OUT/train_speed/train_speed.json" > "$OUT/train_speed/log.txt" 2>&1 \
    && tail -n 2 "$OUT/train_speed/log.txt"
}

target_attention() {  # flex when train_speed measured it at least 5% faster than dense
  "$PY" - "$OUT/train_speed/train_speed.json" << 'EOF'
import json
import sys
from pathlib import Path

p = Path(sys.argv[1])
ratio = json.loads(p.read_text()).get("flex_target_over_fast", 0) if p.exists() else 0
print("flex" if ratio >= 1.05 else "dense")
EOF
}

headline() {  # every checkpoint kept: the steps stage serves each one
  EVALS=t0 full_run && pack_drafter
}
finish() {
  EVALS="t1 eager" EAGER_SETS=gsm8k EAGER_SAMPLES="${EAGER_SAMPLES:-10}" full_run && pack_drafter
}
block8() {  # the same run at block size 8, exported beside it, not published
  PUBLISH="$OUT/block8/export" EVALS=t0 \
    full_run block8 "drafter.block_size=8 training.gamma=4.0"
}

full_run() {  # run dir under $OUT (headline), its training overrides (every checkpoint kept)
  local name="${1:-headline}" extra="${2:-training.keep_last=64}" attention
  attention="$(target_attention)" && echo "target attention: $attention" \
    && DATA="$OUT/data/prep_mask" OUT="$OUT/$name" MAX_NEW_TOKENS="$EVAL_NEW_TOKENS" \
      EXTRA="$extra training.target_attention=$attention ${HEADLINE_EXTRA:-}" \
      bash benchmarks/gpu/headline.sh
}

pack_drafter() {  # the published drafter (weights, config, card) in parts under 16 MB
  local pub="${PUBLISH:-$REPO/drafters/smollm2-135m-dflash-b16}"
  rm -f "$RET"/drafter.tgz.part-*
  tar czf - -C "$(dirname "$pub")" "$(basename "$pub")" \
    | split -b 15000000 - "$RET/drafter.tgz.part-"
}

for s in ${STAGES:-data headline steps scaling finish}; do
  case $s in
    gpu_tests | published | speed | data | train_speed | scaling | headline | steps | block8 | \
      finish)
      stage "$s" "$s"
      ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
pack
echo "== all stages ended ($(date -u +%H:%M:%S))"
