#!/usr/bin/env bash
# Regeneration speed on one GPU: the static batch engine against HF batched `generate`, same
# process, same prompts (benchmarks/regenerate_speed.py), in a few engine settings.
#
#   PROMPTS=prompts.jsonl bash benchmarks/gpu/regenerate_speed.sh
#
# Variants (one JSON each): `rows256` (the default engine, 2,048 prompts: comparable with the
#   published result), `rows256_compiled` (--compile-decode), `rows1024_compiled` (1,024 rows,
#   8,192 prompts: a longer job, where builds and the tail of the queue weigh less),
#   `rows1024_flex` (the same with --decode-attention flex: each row reads its own length),
#   `rows1024_all` (flex decode attention and compiled prefills).
# Inputs: PROMPTS, conversations or a prompts JSONL (e.g. `dflash data prompts --sources
#   smollm2-mix` output); the SmolLM2 asset package.
# Knobs: MODEL (asset:smollm2-135m-instruct), NEW (128), VARIANTS (all three), OUT
#   (benchmarks/out/regenerate_speed), ENGINE_ARGS (more regenerate_speed.py flags for every
#   variant, e.g. "--decode-sdpa efficient --warm-pass").
# Outputs: $OUT/<variant>.json (tokens/s of both paths, the engine's time by stage, a profiled
#   pass's top kernels, greedy identity and fp32 logit gaps at divergences), $OUT/<variant>.log
# Runtime: about 2 minutes a variant on an H200.
# Result document: benchmarks/small_target_speed_h200_202612.md
source "$(dirname "$0")/../lib.sh"
OUT="${OUT:-$REPO/benchmarks/out/regenerate_speed}"
MODEL="${MODEL:-asset:smollm2-135m-instruct}"
: "${PROMPTS:?set PROMPTS to a prompts or conversations JSONL}"
mkdir -p "$OUT"
report_env | tee "$OUT/env.txt"
run() {  # name, then extra arguments
  local name=$1
  shift
  echo "== $name"
  "$PY" benchmarks/regenerate_speed.py --model "$MODEL" --input "$PROMPTS" \
    --max-new-tokens "${NEW:-128}" --out "$OUT/$name.json" "$@" ${ENGINE_ARGS:-} \
    > "$OUT/$name.log" 2>&1 \
    || { tail -n 20 "$OUT/$name.log"; return 1; }
  "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in
    ('engine_tokens_per_s', 'hf_batched_tokens_per_s', 'speedup', 'engine_breakdown_s',
     'engine_ms_per_decode_step')})" "$OUT/$name.json"
}
failed=()
for v in ${VARIANTS:-rows256 rows256_compiled rows1024_compiled}; do
  # A variant that fails is reported and the next one still runs.
  case $v in
    rows256) run "$v" --max-prompts 2048 --hf-prompts 256 ;;
    rows256_compiled) run "$v" --max-prompts 2048 --hf-prompts 256 --compile-decode ;;
    rows1024_compiled) run "$v" --max-prompts 8192 --hf-prompts 256 --batch-size 1024 \
      --compile-decode --fp32-prompts 0 ;;
    rows1024_flex) run "$v" --max-prompts 8192 --hf-prompts 256 --batch-size 1024 \
      --compile-decode --decode-attention flex --fp32-prompts 0 ;;
    rows1024_all) run "$v" --max-prompts 8192 --hf-prompts 256 --batch-size 1024 \
      --compile-decode --decode-attention flex --compile-prefill --fp32-prompts 0 ;;
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac || failed+=("$v")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed variants: ${failed[*]} (logs in $OUT)" >&2
  exit 1
fi
