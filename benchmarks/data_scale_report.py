"""The mixture of a regenerated training set, as JSON: what `benchmarks/gpu/data_scale.sh` records.

Reads the regenerated conversations (`dflash data regenerate` output, JSONL, optionally .gz),
the prompts file's `.sources.json` (what each source gave and what decontamination dropped),
an optional synthesis report (`dflash data synthesize`'s `.report.json`) and the prepared
directory's manifest (supervised tokens per source), and writes one JSON with at least
`assistant_turns`, `supervised_tokens`, `sources` and `decontaminated_dropped`.

    python benchmarks/data_scale_report.py --regen OUT/regen.jsonl --sidecar PROMPTS.sources.json \
        --prepared OUT/prep [--synth-report SYNTH.report.json] --out data_scale.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import zlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def _lines(path: Path) -> Any:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


LOOP_TAIL_CHARS = 1500
LOOP_RATIO = 0.15


def ends_in_a_loop(answer: str) -> bool:
    """Whether an answer's last 1,500 characters compress below 15% of their size (zlib):
    text that repeats a short cycle. Why: a small target stopped by `max_new_tokens` often
    repeats itself to the limit; such tails are most of the supervised tokens and the
    easiest ones, so they inflate token counts and in-batch tau."""
    tail = answer[-LOOP_TAIL_CHARS:].encode()
    return len(tail) >= 200 and len(zlib.compress(tail, 9)) < LOOP_RATIO * len(tail)


def regen_counts(paths: list[Path]) -> dict[str, Any]:
    """Assistant turns, answers stopped by length or by the loop stop, those ending in a loop
    and completion tokens, per source prefix."""
    per: dict[str, Counter] = defaultdict(Counter)
    for path in paths:
        for rec in _lines(path):
            if "messages" not in rec:
                continue  # the settings header
            src = str(rec.get("id", "")).split("/", 1)[0]
            gen = rec.get("generation", {})
            reasons = gen.get("finish_reasons", [])
            per[src]["conversations"] += 1
            per[src]["assistant_turns"] += len(reasons)
            per[src]["stopped_by_length"] += sum(r == "length" for r in reasons)
            per[src]["completion_tokens"] += sum(gen.get("completion_tokens", []))
            answers = [
                m.get("content", "") for m in rec["messages"] if m.get("role") == "assistant"
            ]
            per[src]["stopped_by_loop_stop"] += sum(r == "loop" for r in reasons)
            for text, reason, n in zip(answers, reasons, gen.get("completion_tokens", [])):
                # an answer the loop stop ended (`--stop-loops`) is a loop by construction
                if reason == "loop" or (reason == "length" and ends_in_a_loop(str(text))):
                    per[src]["stopped_in_a_loop"] += 1
                    per[src]["stopped_in_a_loop_tokens"] += n
    return {k: dict(v) for k, v in sorted(per.items())}


def logged_runs(paths: list[Path]) -> list[dict[str, Any]]:
    """The runs `dflash data regenerate` logged beside each output (`<out>.runs.jsonl`)."""
    keep = ("seconds", "new_tokens", "tokens_per_second", "written", "already_done")
    keep += ("continued", "cut_at_interrupt", "time_limit_reached", "engine", "finished_at")
    runs = []
    for path in paths:
        log = path.with_name(path.name + ".runs.jsonl")
        for run in map(json.loads, log.read_text().splitlines() if log.is_file() else []):
            runs.append({"output": str(path), **{k: run.get(k) for k in keep}})
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--regen", type=Path, nargs="+", required=True)
    ap.add_argument("--sidecar", type=Path, required=True)
    ap.add_argument("--prepared", type=Path)
    ap.add_argument("--synth-report", type=Path)
    ap.add_argument("--extra", type=Path, help="a JSON of settings/timings merged in as is")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    regen = regen_counts(args.regen)
    sidecar = json.loads(args.sidecar.read_text())
    prepared: dict[str, Any] = {}
    if args.prepared and (args.prepared / "manifest.json").is_file():
        prepared = json.loads((args.prepared / "manifest.json").read_text())
    by_source_prep = prepared.get("sources", {}) or {}
    sources: dict[str, Any] = {}
    for s in sidecar.get("sources", []):
        name = s["name"]
        sources[name] = {
            "prompts_written": s.get("written"),
            "user_turns": s.get("user_turns"),
            "decontaminated": s.get("decontaminated"),
            "decontaminated_by": s.get("decontaminated_by"),
            **regen.get(name, {}),
            "prepared": by_source_prep.get(name),
        }
    for name, counts in regen.items():
        sources.setdefault(name, {**counts, "prepared": by_source_prep.get(name)})
    splits = prepared.get("splits", {})
    out: dict[str, Any] = {
        "assistant_turns": sum(v.get("assistant_turns", 0) for v in regen.values()),
        "conversations": sum(v.get("conversations", 0) for v in regen.values()),
        "stopped_by_length": sum(v.get("stopped_by_length", 0) for v in regen.values()),
        "stopped_in_a_loop": sum(v.get("stopped_in_a_loop", 0) for v in regen.values()),
        "stopped_in_a_loop_tokens": sum(
            v.get("stopped_in_a_loop_tokens", 0) for v in regen.values()
        ),
        "completion_tokens": sum(v.get("completion_tokens", 0) for v in regen.values()),
        "supervised_tokens": sum(sp.get("supervised_tokens", 0) for sp in splits.values()),
        "tokens": sum(sp.get("tokens", 0) for sp in splits.values()),
        "splits": {
            k: {kk: vv for kk, vv in v.items() if kk != "shards"} for k, v in splits.items()
        },
        "decontaminated_dropped": sidecar.get("decontamination", {}).get("dropped"),
        "decontamination": sidecar.get("decontamination"),
        "sources": sources,
    }
    if args.synth_report and args.synth_report.is_file():
        out["synthesized"] = json.loads(args.synth_report.read_text())
    logged = logged_runs(args.regen)
    if logged:
        out["regeneration_runs"] = logged
    if args.extra and args.extra.is_file():
        out.update(json.loads(args.extra.read_text()))
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("sources", "splits")}, indent=1))


if __name__ == "__main__":
    main()
