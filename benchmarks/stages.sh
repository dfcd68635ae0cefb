# Stage running and result packing for the GPU drivers (sourced after lib.sh): each stage's
# results are packed into $RET/results.tgz as soon as it ends, and every minute while it runs,
# so that a machine lost midway still leaves what was finished.
#
#   OUT=... RET=$OUT/ret; source benchmarks/stages.sh; stage NAME COMMAND...; pack
#
# A stage whose `done_NAME` marker exists under $OUT is skipped; a failed stage is reported and
# the next one still runs.

pack() {  # every small result under $OUT into $RET/results.tgz, written whole or not at all
  local tmp="$RET/.results.$BASHPID"  # the minute packer and a stage may pack at once
  (cd "$OUT" && find . -path ./ret -prune -o -type f \( -name '*.json' -o -name '*.md' \
    -o -name '*.png' -o -name '*.log' -o -name '*.txt' -o -name '*.jsonl' \) -size -8M -print \
    | grep -v -e '/compile_cache/' -e '/prompts.jsonl' -e '/regen.jsonl' -e '/synth' -e '/sample_' -e '/all_prompts' \
    | tar czf "$tmp" -T -) && mv "$tmp" "$RET/results.tgz"
}

stage() {  # name, then the command; skipped when done, packed either way
  local name=$1
  shift
  if [ -e "$OUT/done_$name" ]; then echo "== $name: done"; return 0; fi
  echo "== $name ($(date -u +%H:%M:%S))"
  local t0=$SECONDS
  if "$@"; then
    echo "$((SECONDS - t0))" > "$OUT/done_$name"
    echo "== $name finished in $((SECONDS - t0)) s"
  else
    echo "== $name FAILED after $((SECONDS - t0)) s (log above or under $OUT); later stages go on"
  fi
  pack
}

start_packer() {  # pack every minute as well: a poll sees progress, not only finished stages
  (while sleep 60; do pack 2> /dev/null; done) &
  packer=$!
  trap 'kill $packer 2> /dev/null' EXIT
}
