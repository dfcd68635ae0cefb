#!/usr/bin/env bash
# The session-6 SmolLM2 sweep as one detached job (setsid: it outlives the device call that
# starts it). Seven runs of 800 steps (the recipe, then one change each: block 8, 1 and 3
# drafter layers, kl loss, dpace weighting, no noise) and one long run (the recipe with dpace
# weighting, the best of sessions 2 and 4, cosine over 3,000 steps = 8.3 epochs; call 3 stops
# it with SIGTERM if it has not finished). They train side by side on the one GPU. Each run
# then evaluates its drafter on GSM8K, MT-Bench and HumanEval (10 prompts each, the long run
# 20; 256 new tokens, temperature 0, bf16, CUDA-graph decoding); the long run also at temperature 1, in
# fp32 (the lossless check without bf16 ties), and with eager HF decoding on 5 GSM8K prompts
# (the speedup against plain HF decoding). `$W/out/done_<name>` marks a finished run.
#   setsid bash benchmarks/h200_s6_sweep.sh WORKDIR &
set -u
W=$1
D="python3 -m dflash_trainer.cli"
COMMON="data.train=$W/prep training.log_every=25 training.warmup_ratio=0.03 training.checkpoint_every=500"
declare -A RUNS=(
  [long]="training.max_steps=3000 training.weighting=dpace training.eval_every=1200 eval.train_eval_samples=4 eval.max_new_tokens=96 eval.train_walk_docs=8"
  [base]="training.max_steps=800"
  [block8]="training.max_steps=800 drafter.block_size=8 training.gamma=4.0"
  [layers1]="training.max_steps=800 drafter.num_layers=1"
  [layers3]="training.max_steps=800 drafter.num_layers=3"
  [kl]="training.max_steps=800 training.loss=kl"
  [dpace]="training.max_steps=800 training.weighting=dpace"
  [nonoise]="training.max_steps=800 training.noise_std=0"
)
SETS=gsm8k,mt-bench,humaneval
ev() {  # run tag limit_s eval-args...
  local run=$1 tag=$2 limit=$3; shift 3
  timeout $limit $D eval --drafter "$W/runs/$run" --out-dir "$W/out/eval_$tag" --no-progress "$@" \
    > "$W/out/eval_$tag.log" 2>&1
  echo "eval rc=$?" >> "$W/out/eval_$tag.log"
}
for name in "${!RUNS[@]}"; do
  (
    timeout -s TERM 1500 $D train --recipe smollm2-135m $COMMON ${RUNS[$name]} \
      run.output_dir="$W/runs/$name" --skip-doctor >> "$W/out/train_$name.log" 2>&1
    echo "train rc=$?" >> "$W/out/train_$name.log"
    cp "$W/runs/$name/metrics.jsonl" "$W/out/metrics_$name.jsonl"
    if [ "$name" = long ]; then
      # t=0 bf16 alone on the GPU (the clean speed measurement), then the other three together.
      ev long long_t0 300 --prompts $SETS --max-samples 20 --max-new-tokens 256 --temperature 0 --allow-mismatch
      ev long long_t1 420 --prompts $SETS --max-samples 20 --max-new-tokens 256 --temperature 1 &
      ev long long_fp32_t0 420 --prompts $SETS --max-samples 20 --max-new-tokens 256 --temperature 0 --target-dtype float32 &
      ev long long_eager_t0 420 --prompts gsm8k --max-samples 5 --max-new-tokens 128 --temperature 0 --decode eager --allow-mismatch &
      wait
    else
      ev "$name" "$name" 600 --prompts $SETS --max-samples 10 --max-new-tokens 256 --temperature 0 --allow-mismatch
    fi
    touch "$W/out/done_$name"
  ) &
done
wait
