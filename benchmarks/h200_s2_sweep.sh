#!/usr/bin/env bash
# The SmolLM2 sweep: 8 training runs side by side on one H200 (each is launch-bound and
# fills a fraction of the GPU alone). `start` launches them; `resume` continues them from
# their last checkpoints. Every run ends by SIGTERM (checkpoint saved) or at max_steps.
# `finish` resumes them for at most SECONDS of training, then evaluates each drafter.
#   bash benchmarks/h200_s2_sweep.sh WORKDIR start|finish SECONDS
set -u
W=$1; MODE=$2; SECS=$3
D="python3 -m dflash_trainer.cli"
COMMON="data.train=$W/prep training.log_every=25 training.warmup_ratio=0.03 training.checkpoint_every=200"
declare -A RUNS=(
  [main]="training.max_steps=1500 training.eval_every=250 eval.train_eval_samples=4 eval.max_new_tokens=96"
  [base]="training.max_steps=400"
  [block8]="training.max_steps=400 drafter.block_size=8 training.gamma=4.0"
  [layers1]="training.max_steps=400 drafter.num_layers=1"
  [layers3]="training.max_steps=400 drafter.num_layers=3"
  [kl]="training.max_steps=400 training.loss=kl"
  [dpace]="training.max_steps=400 training.weighting=dpace"
  [nonoise]="training.max_steps=400 training.noise_std=0"
)
eval_run() {
  local name=$1 e="$D eval --drafter $W/runs/$1 --prompts gsm8k,mt-bench,humaneval"
  if [ "$name" = main ]; then
    timeout 320 $e --max-samples 8 --max-new-tokens 160 ${EVAL_EXTRA:-} --out-dir "$W/out/eval_main_t0" > "$W/out/eval_main_t0.log" 2>&1 &
    timeout 320 $e --max-samples 8 --max-new-tokens 160 --temperature 1 ${EVAL_EXTRA:-} --out-dir "$W/out/eval_main_t1" > "$W/out/eval_main_t1.log" 2>&1 &
    wait
  else
    timeout 320 $e --max-samples 8 --max-new-tokens 128 ${EVAL_EXTRA:-} --out-dir "$W/out/eval_$name" > "$W/out/eval_$name.log" 2>&1
  fi
}
# ONLY="main base" limits the runs (local smoke tests); EVAL_EXTRA adds eval flags.
NAMES="${ONLY:-${!RUNS[*]}}"
for name in $NAMES; do
  if [ "$MODE" = start ]; then
    args="--recipe smollm2-135m $COMMON ${RUNS[$name]} run.output_dir=$W/runs/$name --skip-doctor"
  else
    args="--resume $W/runs/$name"
  fi
  (
    timeout -s TERM "$SECS" $D train $args >> "$W/out/train_$name.log" 2>&1
    echo "train rc=$?" >> "$W/out/train_$name.log"
    if [ "$MODE" = finish ]; then eval_run "$name"; fi
  ) &
done
wait
for name in $NAMES; do
  cp "$W/runs/$name/metrics.jsonl" "$W/out/metrics_$name.jsonl" 2>/dev/null
  printf '%-8s ' "$name"; tail -n 1 "$W/runs/$name/metrics.jsonl" 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read() or '{}'); print({k: round(r[k],3) if isinstance(r.get(k), float) else r.get(k) for k in ('step','loss','exact_tau','step_time_s','tokens_per_s')})"
done
