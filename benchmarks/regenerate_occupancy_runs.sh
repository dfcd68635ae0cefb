#!/usr/bin/env bash
# The runs of regenerate_occupancy_cpu_202612.md: each workload with the draining engine
# (--no-carry-rows) and the engine as it is, one JSON and log per run in
# benchmarks/results/regenerate_occupancy_cpu_202612/ (OUT to change). CPU only, about 5 min.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/regenerate_occupancy_cpu_202612}
mkdir -p "$OUT"
run() {  # name, then the benchmark's arguments
  local name=$1
  shift
  "$PYTHON" benchmarks/regenerate_occupancy.py "$@" --no-carry-rows --out "$OUT/drain_$name.json" \
    >"$OUT/drain_$name.log" 2>&1
  "$PYTHON" benchmarks/regenerate_occupancy.py "$@" --out "$OUT/carry_$name.json" \
    >"$OUT/carry_$name.log" 2>&1
  tail -n 2 "$OUT/carry_$name.log"
}
run rows64
run rows64_target_answers --answers-at-limit 0.596
run rows64_no_row_cap --kv-positions-per-row 0
run rows256 --rows 256 --conversations 2048
run rows64_resumed_after_2 --resume-after 2 --conversations 1024
