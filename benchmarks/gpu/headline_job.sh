#!/usr/bin/env bash
# One time-limited GPU job of the headline drafter's lineage: fresh prompts, a continuation from
# the published drafter, both served side by side, the new drafter and the results brought back.
# Jobs add up: each continuation records what it trained on in the drafter's lineage.json
# (docs/lineage.md), and the next job never trains on an assistant turn recorded there.
#
#   bash benchmarks/gpu/headline_job.sh
#   DEVICE=cpu OUT=/tmp/job bash benchmarks/gpu/headline_job.sh     # the CPU rehearsal
#
# Stages (STAGES, in order; finished ones skipped, a failed one reported and the next run; one
#   that works on an earlier stage's output fails at once while that stage has not finished):
#   setup    INIT copied to $OUT/init; a drafter without lineage.json gets its first
#            continuation recorded (`dflash lineage init`): every prompt id of the data it was
#            trained on (GENESIS_MIX's prompts and GENESIS_SYNTH synthesized ids, as
#            benchmarks/gpu/data_scale.sh made them) and the totals of GENESIS_* knobs
#   regen    fresh prompts: SYNTH_N synthesized with seed SEED (default: the number of recorded
#            continuations, so no job repeats a seed; ids `synth-s<SEED>/...`) and whatever
#            MIX offers that the lineage does not record every turn of, both with
#            --exclude-lineage (a conversation with turns left keeps them), then
#            regenerated (all turns, loop stop) for REGEN_SECONDS
#   prepare  the regenerated set, loop tails masked, recorded turns context only, prompts
#            with no new turn left out (counted)
#   train    `dflash train --init-from $OUT/init` to the end of its schedule (a fresh optimizer,
#            the schedule's warmup again); an interrupted run resumes from its checkpoint
#   export   the new drafter exported (z-lab layout, bf16, its lineage carried)
#   pack     the export in parts under 15 MB ($RET/drafter.tgz.part-*), before the evaluation,
#            so a job cut short still brings its drafter back; job.json says whether to publish
#   eval     the export served beside
#            INIT (benchmarks/dflash2_vs_dflash.py: one CUDA-graph target-only baseline per set
#            and temperature; GSM8K, MT-Bench both turns, HumanEval; t=0 and t=1); the numbers
#            attached to both continuations; $OUT/job.json says which drafter is better on the
#            mean t=0 tau; the lineage curve (benchmarks/lineage_curve.py)
# Inputs: INIT (drafters/smollm2-135m-dflash-b16), the SmolLM2, corpora and eval-set asset
#   packages (benchmarks/offline_bundle.sh).
# Knobs: REGEN_SECONDS (900), SYNTH_N (20000), SEED, MIX (smollm2-mix; "" for none), STEPS (the
#   recipe's epochs when empty), EPOCHS (the recipe's 6 when empty), LR (3e-4), WARMUP (0.02),
#   KIND (dflash; dflash2 when INIT is a DFlash2 drafter, e.g. drafters/smollm2-135m-dflash2-b16),
#   SELECTOR_LR_SCALE (1: a DFlash2 INIT's selector is trained already),
#   MIN_RECORDS (200: fewer regenerated conversations fail the regen stage; the time limit
#   includes the engine's compile, about 80 s), SAMPLES (40), EVAL_NEW_TOKENS (256), TEMPS ("0,1"; an eval stage run again with other
#   temperatures adds to the comparison JSON), ALSO_GREEDY (1: the new drafter served once more with
#   argmax drafts at t > 0; 0 saves that evaluation),
#   ENGINE_ARGS ("--batch-size 1024 --compile-decode --decode-sdpa cudnn --prefill-sdpa cudnn"),
#   GENESIS_MIX (smollm2-mix), GENESIS_SYNTH (10000), GENESIS_STEPS (1200), GENESIS_TURNS
#   (102927), GENESIS_TOKENS (11447505), GENESIS_DOCS (40646), DEVICE (cuda; cpu rehearses
#   with tiny knobs), OUT (benchmarks/out/headline_job), RET ($OUT/ret).
# Outputs: $OUT/job.json (data, eval of both drafters, decision), $OUT/headline_smollm2.json
#   (the headline JSON's shape, with "lineage"), $OUT/curve/lineage_curve.{json,png},
#   $OUT/export/ (the new drafter with lineage.json and its card), $RET/results.tgz.
# Runtime on one H100 (estimated from benchmarks/data_scale_smollm2_h200_202612.md and the
#   headline run): setup ~2 min, regen REGEN_SECONDS + ~3 min (synthesis, compile), prepare
#   ~1 min, train ~9 min for 6 epochs of ~40k conversations, eval ~15 min, pack <1 min.
#   Measured on an H200: synthesis of SYNTH_N=5000 about 190 s (3,611 kept), the regeneration
#   engine's compile 65-80 s of REGEN_SECONDS; at 40 prompts a set, each drafter's t=0 or t=1
#   pass over the three sets about 2 min, plus one target-only baseline per set and
#   temperature (about 2 min a temperature). Job 1 (benchmarks/headline_job_smollm2_h200_202612.md,
#   SYNTH_N=4000 REGEN_SECONDS=200 EPOCHS=4): setup + regen + prepare 4.5 min (2,898
#   conversations), train + export + pack 1.7 min (44 steps), eval at t=0 5.2 min.
#   The CPU rehearsal on 2 shared cores: setup 32 s (the genesis: 45,041 prompt ids), regen
#   169 s (35,041 mixture prompts left out as recorded, 2 synthesized ones regenerated), prepare
#   6 s, train 49 s (2 steps), eval 233 s (1 prompt a set, 8 tokens), pack 3 s (3 parts).
#   With INIT=drafters/smollm2-135m-dflash2-b16 KIND=dflash2: regen 133 s, prepare 9 s, train
#   182 s, export 12 s, pack 12 s (5 parts), eval 85 s; `verify --last` prints the reuse its
#   lineage already records and passes.
# Result document: benchmarks/headline_job_smollm2_<gpu>_<date>.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/headline_job}"
RET="${RET:-$OUT/ret}"
DEVICE="${DEVICE:-cuda}"
INIT="${INIT:-$PUBLISHED_DRAFTER}"
MODEL=asset:smollm2-135m-instruct
mkdir -p "$OUT" "$RET"
source "$REPO/benchmarks/stages.sh"
start_packer
report_env | tee "$OUT/env.txt"

if [ "$DEVICE" = cuda ]; then
  ENGINE_ARGS="${ENGINE_ARGS:---batch-size 1024 --compile-decode --decode-sdpa cudnn --prefill-sdpa cudnn}"
  SYNTH_ARGS=() TRAIN_DEVICE=() EVAL_DEVICE=()
else  # the rehearsal: the same commands at sizes a CPU runs in minutes
  ENGINE_ARGS="--batch-size 4" SYNTH_N="${SYNTH_N:-4}" REGEN_SECONDS="${REGEN_SECONDS:-60}"
  SYNTH_ARGS=(--backend hf --max-new-tokens 64)
  REGEN_NEW_TOKENS="${REGEN_NEW_TOKENS:-24}" STEPS="${STEPS:-2}" SAMPLES="${SAMPLES:-1}"
  MIN_RECORDS="${MIN_RECORDS:-1}"
  EVAL_NEW_TOKENS="${EVAL_NEW_TOKENS:-8}" SETS="${SETS:-gsm8k,mt-bench}"
  TRAIN_DEVICE=(training.device=cpu data.max_doc_tokens=512 data.token_budget=2048
    training.max_anchors=64)
  EVAL_DEVICE=(--device cpu --decode eager)
fi

needs() {  # a stage that works on what an earlier one made runs only after it finished
  [ -e "$OUT/done_$1" ] || { echo "the $1 stage has not finished: nothing to work on"; return 1; }
}

case "${MIN_RECORDS:-200}" in
  '' | *[!0-9]*) echo "MIN_RECORDS=${MIN_RECORDS} must be a whole number" >&2; exit 2 ;;
esac
case "${KIND:-dflash}" in
  dflash | dflash2) ;;
  *) echo "KIND=${KIND} must be dflash or dflash2 (the kind of the INIT drafter)" >&2; exit 2 ;;
esac

continuations() {  # recorded continuations of the drafter at $1
  $DFLASH lineage show "$1" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["continuations"])'
}

setup() {
  [ -d "$OUT/init" ] || cp -r "$INIT" "$OUT/init"
  [ -e "$OUT/init/lineage.json" ] && return 0
  local mix="${GENESIS_MIX-smollm2-mix}" prompts=()
  if [ -n "$mix" ]; then
    $DFLASH data prompts --sources "$mix" --seed 0 --out "$OUT/genesis/prompts.jsonl" \
      > "$OUT/genesis.log" 2>&1 || return 1
    prompts+=(--prompts "$OUT/genesis/prompts.jsonl")
  fi
  "$PY" -c 'import json, sys
for i in range(int(sys.argv[1])):
    print(json.dumps({"id": f"synth/synth-{i:07d}"}))' "${GENESIS_SYNTH:-10000}" \
    > "$OUT/genesis/synth_ids.jsonl"
  $DFLASH lineage init "$OUT/init" "${prompts[@]}" --prompts "$OUT/genesis/synth_ids.jsonl" \
    --steps "${GENESIS_STEPS:-1200}" --assistant-turns "${GENESIS_TURNS:-102927}" \
    --supervised-tokens "${GENESIS_TOKENS:-11447505}" --documents "${GENESIS_DOCS:-40646}" \
    --note "the data-at-scale set (benchmarks/data_scale_smollm2_h200_202612.md): every prompt id of $mix seed 0 and synthesized items 0..$((${GENESIS_SYNTH:-10000} - 1)), counted as trained whole" \
    | tee -a "$OUT/genesis.log"
}

regen() {
  local seed="${SEED:-}" d="$OUT/regen" sources=()
  [ -n "$seed" ] || seed="$(continuations "$OUT/init")" || return 1
  mkdir -p "$d" && echo "seed $seed" | tee "$d/seed.txt"
  if [ ! -e "$d/synth.jsonl" ]; then
    $DFLASH data synthesize --model "$MODEL" --n "${SYNTH_N:-20000}" --seed "$seed" \
      --topics math,code,chat,writing --device "$DEVICE" --no-progress \
      --out "$d/synth_raw.jsonl" $ENGINE_ARGS "${SYNTH_ARGS[@]}" > "$d/synth.log" 2>&1 || return 1
    printf 'sources:\n  - name: synth-s%s\n    path: %s\n    messages: messages\n' "$seed" \
      "$d/synth_raw.jsonl" > "$d/synth_source.yaml"
    $DFLASH data prompts --sources "$d/synth_source.yaml" --seed "$seed" \
      --exclude-lineage "$OUT/init" --out "$d/synth.jsonl" >> "$d/synth.log" 2>&1 || return 1
  fi
  if [ -n "${MIX-smollm2-mix}" ] && [ ! -e "$d/mix.jsonl" ]; then
    $DFLASH data prompts --sources "${MIX-smollm2-mix}" --seed "$seed" \
      --exclude-lineage "$OUT/init" --out "$d/mix.jsonl" > "$d/mix.log" 2>&1 || return 1
  fi
  [ -e "$d/mix.jsonl" ] && sources+=("$d/mix.jsonl")
  paste -d '\n' "$d/synth.jsonl" "${sources[@]}" | sed '/^$/d' > "$d/all_prompts.jsonl"
  [ -s "$d/all_prompts.jsonl" ] || { echo "no fresh prompts (all recorded in the lineage?)"; return 1; }
  $DFLASH data regenerate --input "$d/all_prompts.jsonl" --model "$MODEL" --out "$d/regen.jsonl" \
    --max-new-tokens "${REGEN_NEW_TOKENS:-512}" --max-conversation-tokens 4096 --seed "$seed" \
    --device "$DEVICE" --no-progress --stop-loops --exclude-lineage "$OUT/init" \
    --time-limit "${REGEN_SECONDS:-900}" $ENGINE_ARGS > "$d/regen.log" 2>&1
  local rc=$? n
  tail -n 3 "$d/regen.log"
  [ $rc = 0 ] || return $rc
  # The time limit counts the engine's compile (about 80 s on an H200): a limit near it
  # answers almost nothing, and a continuation on a handful of turns is no job.
  n="$(wc -l < "$d/regen.jsonl")"
  if [ "$n" -lt "${MIN_RECORDS:-200}" ]; then
    echo "only $n conversations regenerated in REGEN_SECONDS=${REGEN_SECONDS:-900} s (MIN_RECORDS=${MIN_RECORDS:-200}): raise REGEN_SECONDS; rerunning the stage continues them"
    return 1
  fi
}

prepare() {
  needs regen || return 1
  $DFLASH data prepare --input "$OUT/regen/regen.jsonl" --tokenizer "$MODEL" --out "$OUT/prep" \
    --eval-fraction 0.01 --loop-tails mask --exclude-lineage "$OUT/init" --overwrite \
    > "$OUT/prepare.log" 2>&1
  local rc=$?
  head -n 8 "$OUT/prepare.log"
  return $rc
}

train() {
  [ -e "$OUT/run/drafter/lineage.json" ] && return 0
  needs prepare || return 1
  local args=(--recipe smollm2-135m --init-from "$OUT/init")
  # A DFlash2 INIT continues as DFlash2: its selector's codebooks are trained tables.
  [ "${KIND:-dflash}" = dflash2 ] && args+=(drafter.kind=dflash2 drafter.selector_codebooks=tables
    "training.selector_lr_scale=${SELECTOR_LR_SCALE:-1}")
  [ -e "$OUT/run/checkpoints/LATEST" ] && args=(--resume "$OUT/run")
  local steps=()
  [ -n "${STEPS:-}" ] && steps=("training.max_steps=$STEPS")
  [ -n "${EPOCHS:-}" ] && steps+=("training.epochs=$EPOCHS")
  $DFLASH train "${args[@]}" "data.train=$OUT/prep" "run.output_dir=$OUT/run" \
    "training.lr=${LR:-3e-4}" "training.warmup_ratio=${WARMUP:-0.02}" training.eval_every=0 \
    "${steps[@]}" "${TRAIN_DEVICE[@]}" > "$OUT/train.log" 2>&1
  local rc=$?
  grep -v '^train:' "$OUT/train.log" | tail -n 4
  return $rc
}

export_drafter() {
  needs train || return 1
  $DFLASH export "$OUT/run" --to zlab "$OUT/export" --force > "$OUT/export.log" 2>&1
}

serve() {
  local k also=()
  [ -e "$OUT/export/lineage.json" ] || { echo "no exported drafter (the export stage)"; return 1; }
  k="$(continuations "$OUT/export")" || return 1
  # At t > 0 both drafters draft by sampling (dflash eval's default), and the new one once
  # more with argmax drafts (ALSO_GREEDY=1), so the two modes stay comparable job after job.
  [ "${ALSO_GREEDY:-1}" = 1 ] && also=(--also "new_greedy=$OUT/export:greedy")
  "$PY" benchmarks/dflash2_vs_dflash.py --drafter "new=$OUT/export" --drafter "published=$OUT/init" \
    "${also[@]}" \
    --sets "${SETS:-gsm8k,mt-bench,humaneval}" --samples "${SAMPLES:-40}" --candidates 0 \
    --max-new-tokens "${EVAL_NEW_TOKENS:-256}" --temperatures "${TEMPS:-0,1}" --out "$OUT/eval" \
    "${EVAL_DEVICE[@]}" > "$OUT/eval.log" 2>&1 || return 1
  local report="$OUT/eval/dflash2_vs_dflash.json"
  $DFLASH lineage add-eval "$OUT/export" "$report" --name new \
    && $DFLASH lineage add-eval "$OUT/export" "$report" --name published --continuation $((k - 2)) \
    && $DFLASH lineage verify "$OUT/export" --last \
    && "$PY" benchmarks/headline_job_report.py --eval "$report" --drafter "$OUT/export" \
      --out "$OUT" \
    && "$PY" benchmarks/lineage_curve.py "$OUT/export" --out "$OUT/curve/lineage_curve"
}

pack_drafter() {
  [ -d "$OUT/export" ] || { echo "no exported drafter"; return 1; }
  rm -f "$RET"/drafter.tgz.part-*
  tar czf - -C "$OUT" export | split -b 15000000 - "$RET/drafter.tgz.part-"
  ls -l "$RET"
}

for s in ${STAGES:-setup regen prepare train export pack eval}; do
  case $s in
    setup | regen | prepare | train) stage "$s" "$s" ;;
    export) stage export export_drafter ;;
    eval) stage eval serve ;;
    pack) stage pack pack_drafter ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
pack
echo "== all stages ended ($(date -u +%H:%M:%S))"
