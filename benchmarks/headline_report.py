"""The headline drafter's numbers as one JSON, from `dflash eval` reports.

Reads the `eval.json` of temperature-0 and temperature-1 evaluations (CUDA-graph decoding,
target-only baseline in the same process) and, optionally, of a temperature-0 evaluation with
`--decode eager` (plain HF decoding) for the speedup over eager decoding. Each temperature
takes one or more reports: a set comes from the first report that holds it (list the GPU
evaluation first; a CPU evaluation run with `--no-baseline` adds tau without a speedup). Every
row says where it was measured (`device`, `dtype`). Writes

    {"gsm8k": {"t0": {"tau", "tau_pooled", "speedup", "prompts", ...}, "t1": {...}},
     "mt-bench": {...}, "humaneval": {...}, "drafter": "<path>", "goals": {...}}

and prints a Markdown table with each goal and whether it is met.

    python benchmarks/headline_report.py --t0 OUT/t0 --t1 OUT/t1 --eager OUT/eager \\
        --drafter drafters/smollm2-135m-dflash-b16 --out headline_smollm2_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.card import read_eval_report

# (set, temperature, metric) -> minimum; the goals of the published SmolLM2 drafter.
GOALS = {
    ("gsm8k", "t0", "tau"): 4.0,
    ("mt-bench", "t0", "tau"): 3.0,
    ("humaneval", "t0", "tau"): 3.5,
    ("gsm8k", "t0", "speedup"): 2.0,
    ("gsm8k", "t1", "tau"): 2.5,
}


def _report(eval_dir: Path, flag: str) -> dict[str, Any]:
    # Through the package's reader: a regular file of bounded size (a FIFO named here would
    # block the report), its sets checked; the message names the file and the fix.
    try:
        return read_eval_report(eval_dir, flag)
    except DFlashError as e:
        raise SystemExit(str(e)) from e


def _where(report: dict[str, Any]) -> dict[str, Any]:
    env = report.get("environment", {})
    return {
        "device": env.get("gpu") or env.get("device"),
        "dtype": report.get("target", {}).get("dtype"),
        "report_created": report.get("created"),
    }


def _row(s: dict[str, Any], where: dict[str, Any]) -> dict[str, Any]:
    return {
        **where,
        "tau": s.get("tau"),
        "tau_pooled": s.get("tau_pooled"),
        "speedup": s.get("speedup"),
        "prompts": s.get("num_prompts"),
        "responses": s.get("num_responses"),
        "decode_tokens_per_s": s.get("decode_tokens_per_s"),
        "baseline_decode_tokens_per_s": s.get("baseline_decode_tokens_per_s"),
        "lossless_mismatches": s.get("lossless_mismatches"),
        "accepted_histogram": s.get("accepted_histogram"),
        "per_position_acceptance": s.get("per_position_acceptance"),
    }


def build(t0: list[Path], t1: list[Path], eager: Path | None, drafter: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for temp, dirs in (("t0", t0), ("t1", t1)):
        for d in dirs:
            report = _report(d, f"--{temp}")
            where = _where(report)
            for name, s in report["sets"].items():
                out.setdefault(name, {}).setdefault(temp, _row(s, where))
    if eager is not None:
        for name, s in _report(eager, "--eager")["sets"].items():
            row = out.get(name, {}).get("t0")
            hf = s.get("baseline_decode_tokens_per_s")
            if row and hf and row.get("decode_tokens_per_s"):
                row["eager_hf_tokens_per_s"] = hf
                row["speedup_over_eager_hf"] = row["decode_tokens_per_s"] / hf
    goals = {}
    for (name, temp, metric), need in GOALS.items():
        got = out.get(name, {}).get(temp, {}).get(metric)
        goals[f"{name} {temp} {metric} >= {need}"] = {
            "measured": got,
            "met": got is not None and got >= need,
        }
    return {**out, "drafter": drafter, "goals": goals}


def table(report: dict[str, Any]) -> str:
    lines = ["| goal | measured | met |", "|---|---:|---|"]
    for goal, g in report["goals"].items():
        got = "-" if g["measured"] is None else f"{g['measured']:.2f}"
        lines.append(f"| {goal} | {got} | {'yes' if g['met'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--t0", type=Path, nargs="+", required=True, help="eval dirs (or eval.json) at t=0"
    )
    p.add_argument("--t1", type=Path, nargs="+", default=[], help="eval dirs (or eval.json) at t=1")
    p.add_argument("--eager", type=Path, help="eval dir at t=0 with --decode eager")
    p.add_argument("--drafter", required=True, help="the evaluated drafter's path")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    report = build(args.t0, args.t1, args.eager, args.drafter)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(args.out)
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
