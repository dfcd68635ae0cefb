#!/usr/bin/env bash
# The SmolLM2 sweep as one detached job (setsid: it outlives the device call that starts
# it, so the next call only waits for it). Each run trains, then evaluates its drafter:
# seven sweep runs of 800 steps (GSM8K, MT-Bench, HumanEval, temperature 0), and two long
# runs (the recipe, and the recipe with dpace weighting, the best variant of session 2's
# sweep) at temperature 0 and 1. A long run ends at max_steps or at SIGTERM (checkpoint
# saved; call 3 sends it). Every run writes `$W/out/done_<name>` when it is finished.
#   setsid bash benchmarks/h200_s4_sweep.sh WORKDIR &
set -u
W=$1
D="python3 -m dflash_trainer.cli"
COMMON="data.train=$W/prep training.log_every=25 training.warmup_ratio=0.03 training.checkpoint_every=500"
declare -A RUNS=(
  [main]="training.max_steps=3600 training.eval_every=600 eval.train_eval_samples=4 eval.max_new_tokens=96"
  [dpace_long]="training.max_steps=3600 training.weighting=dpace"
  [base]="training.max_steps=800"
  [block8]="training.max_steps=800 drafter.block_size=8 training.gamma=4.0"
  [layers1]="training.max_steps=800 drafter.num_layers=1"
  [layers3]="training.max_steps=800 drafter.num_layers=3"
  [kl]="training.max_steps=800 training.loss=kl"
  [dpace]="training.max_steps=800 training.weighting=dpace"
  [nonoise]="training.max_steps=800 training.noise_std=0"
)
ev() {  # name tag max_samples max_new_tokens temperature
  timeout 330 $D eval --drafter "$W/runs/$1" --prompts gsm8k,mt-bench,humaneval \
    --max-samples "$3" --max-new-tokens "$4" --temperature "$5" --out-dir "$W/out/eval_$2" \
    > "$W/out/eval_$2.log" 2>&1
  echo "eval rc=$?" >> "$W/out/eval_$2.log"
}
for name in "${!RUNS[@]}"; do
  (
    timeout -s TERM 1500 $D train --recipe smollm2-135m $COMMON ${RUNS[$name]} \
      run.output_dir="$W/runs/$name" --skip-doctor >> "$W/out/train_$name.log" 2>&1
    echo "train rc=$?" >> "$W/out/train_$name.log"
    cp "$W/runs/$name/metrics.jsonl" "$W/out/metrics_$name.jsonl"
    if [ "$name" = main ] || [ "$name" = dpace_long ]; then
      ev "$name" "${name}_t0" 10 160 0 & ev "$name" "${name}_t1" 10 160 1 & wait
    else
      ev "$name" "$name" 8 128 0
    fi
    touch "$W/out/done_$name"
  ) &
done
wait
