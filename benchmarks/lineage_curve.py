"""Served tau against the data a drafter has trained on, one point per continuation (job).

Reads a drafter's lineage (`lineage.json`, lineage/record.py): for every continuation with
served numbers attached (`dflash lineage add-eval`), the cumulative assistant turns and
supervised tokens trained on up to and including it, and its served tau on GSM8K and
MT-Bench at temperature 0. Fits tau linear in the log of each axis (least squares, the
`tau_log_linear` model of benchmarks/scaling_curve.py, whose `acceptance_logistic` model is
fitted too) and says how much data each fit needs for the goals (GSM8K 4.0, MT-Bench 3.0);
a fit that does not grow predicts nothing ("not reached at this rate").

    python benchmarks/lineage_curve.py drafters/smollm2-135m-dflash-b16 --out OUT/lineage_curve \
        [--reference LABEL=TURNS,TOKENS,EVAL_JSON ...]

`--reference` adds a drafter trained from scratch on a smaller set (its assistant turns,
supervised tokens and `dflash eval` report at t=0): continuations a few percent apart in data
say little about the trend on their own, and the same recipe on a tenth of the data says
much. Reference points are drawn hollow and enter the fits; the JSON marks them.

Writes OUT.json ({"points", "fits", "goals"}) and OUT.png (tau against turns, against tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling_curve import fitted, predict

from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.card import read_eval_report
from dflash_trainer.lineage.record import read_lineage
from dflash_trainer.lineage.served import merge_served

GOALS = {"gsm8k": 4.0, "mt-bench": 3.0}
AXES = {"assistant_turns": "assistant turns", "supervised_tokens": "supervised tokens"}
MODELS = ("tau_log_linear", "acceptance_logistic")


def points(lineage: dict[str, Any], sets: list[str]) -> list[dict[str, Any]]:
    """One point per continuation with served numbers: cumulative data and t=0 taus."""
    out, turns, tokens = [], 0, 0
    for c in lineage["continuations"]:
        data = c.get("data") or {}
        turns += int(data.get("assistant_turns") or 0)
        tokens += int(data.get("supervised_tokens") or 0)
        served = merge_served(c.get("evals") or [])
        taus = {s: (served.get(s) or {}).get("t0", {}).get("tau") for s in sets}
        if any(isinstance(t, (int, float)) for t in taus.values()):
            out.append(
                {
                    "continuation": c["index"],
                    "date": c.get("date"),
                    "steps": c.get("steps"),
                    "assistant_turns": turns,
                    "supervised_tokens": tokens,
                    "tau": taus,
                }
            )
    return out


def reference(arg: str, sets: list[str]) -> dict[str, Any]:
    """The point of `--reference LABEL=TURNS,TOKENS,EVAL_JSON`."""
    label, sep, rest = arg.partition("=")
    parts = rest.split(",", 2)
    if not sep or not label or len(parts) != 3 or not all(x.isdigit() for x in parts[:2]):
        raise SystemExit(f"--reference {arg!r}: write LABEL=TURNS,TOKENS,EVAL_JSON")
    try:  # regular files only, size-bounded, checked for its sets
        served = read_eval_report(parts[2], "--reference")["sets"]
    except DFlashError as e:
        raise SystemExit(str(e)) from e
    taus = {s: (served.get(s) or {}).get("tau") for s in sets}
    if not any(isinstance(t, float | int) for t in taus.values()):
        raise SystemExit(f"--reference {arg!r}: the report serves none of {', '.join(sets)}")
    return {"reference": label, "assistant_turns": int(parts[0]),
            "supervised_tokens": int(parts[1]), "tau": taus}  # fmt: skip


def fits(pts: list[dict[str, Any]], block: int, goals: dict[str, float]) -> dict[str, Any]:
    """{axis: {set: predict(...)}}: each set's fits and the data its goal needs."""
    out: dict[str, Any] = {}
    for axis in AXES:
        for name, goal in goals.items():
            have = [p for p in pts if p[axis] > 0 and isinstance(p["tau"].get(name), float | int)]
            xs = [float(p[axis]) for p in have]
            ys = [float(p["tau"][name]) for p in have]
            pred = predict(xs, ys, goal, block) if have else {"goal": goal, "points": 0}
            for model in MODELS:
                entry = pred.get(model)
                if isinstance(entry, dict) and "slope" in entry and "size_for_goal" not in entry:
                    entry["why_none"] = "the fit does not grow: not reached at this rate"
            out.setdefault(axis, {})[name] = pred
    return out


def _plot(
    pts: list[dict[str, Any]], fit: dict[str, Any], block: int, goals: dict[str, float], png: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (axis, label) in zip(axes, AXES.items(), strict=True):
        for (name, goal), color in zip(goals.items(), ("C0", "C1"), strict=True):
            have = [p for p in pts if isinstance(p["tau"].get(name), float | int)]
            xs = [p[axis] for p in have]
            for ref, style in ((False, {}), (True, {"mfc": "none"})):
                mine = [p for p in have if ("reference" in p) == ref]
                ax.plot([p[axis] for p in mine], [p["tau"][name] for p in mine], "o",
                        color=color, label=f"{name} (from scratch)" if ref else name,
                        **style)  # fmt: skip
            ax.axhline(goal, color=color, lw=0.8, ls="--")
            entry = fit[axis][name].get("tau_log_linear") or {}
            if "slope" in entry and xs and min(xs) > 0:
                hi = max(max(xs), min(entry.get("size_for_goal", 0.0), 1000 * max(xs)))
                grid = [min(xs) * (hi / min(xs)) ** (i / 50) for i in range(51)]
                ax.plot(grid, [fitted("tau_log_linear", entry, x, block) for x in grid],
                        ":", color=color, lw=1)  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel(f"cumulative {label} trained on")
        ax.set_ylabel("served tau (t=0)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("served tau per continuation (hollow: a drafter trained from scratch on less); "
                 "dotted: tau linear in log data; dashed: goals")  # fmt: skip
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def table(pts: list[dict[str, Any]], fit: dict[str, Any], goals: dict[str, float]) -> str:
    def tau(x: Any) -> str:
        return f"{x:.2f}" if isinstance(x, float | int) else "-"

    lines = ["| job | assistant turns | supervised tokens | GSM8K tau | MT-Bench tau |",
             "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for p in pts:
        lines.append(
            f"| {p.get('continuation', p.get('reference'))} | {p['assistant_turns']:,} | {p['supervised_tokens']:,} "
            f"| {tau(p['tau'].get('gsm8k'))} | {tau(p['tau'].get('mt-bench'))} |"
        )
    lines += ["", "| goal | turns needed | tokens needed |", "|---|---:|---:|"]
    for name, goal in goals.items():
        need = []
        for axis in AXES:
            e = fit[axis][name].get("tau_log_linear") or {}
            x = e.get("size_for_goal")
            why = e.get("why_none") or fit[axis][name].get("why_none", "-")
            need.append(f"{x:,.0f}" if x and math.isfinite(x) else why)
        lines.append(f"| {name} tau >= {goal} | {need[0]} | {need[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("drafter", help="a drafter or run directory with lineage.json")
    ap.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.png are written")
    ap.add_argument("--block-size", type=int, default=16, help="the drafter's block size")
    ap.add_argument(
        "--goal",
        action="append",
        default=[],
        metavar="SET=TAU",
        help="a goal instead of the defaults (gsm8k=4.0, mt-bench=3.0); repeatable",
    )
    ap.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="LABEL=TURNS,TOKENS,EVAL_JSON",
        help="a drafter trained from scratch on less data, as a point of the fits; repeatable",
    )
    args = ap.parse_args(argv)
    goals = dict(GOALS)
    if args.goal:
        goals = {g.split("=", 1)[0]: float(g.split("=", 1)[1]) for g in args.goal}
    lineage = read_lineage(args.drafter)
    if lineage is None:
        raise SystemExit(f"{args.drafter}: no lineage.json (nor drafter/lineage.json)")
    pts = [reference(r, list(goals)) for r in args.reference] + points(lineage, list(goals))
    pts.sort(key=lambda p: p["assistant_turns"])
    fit = fits(pts, args.block_size, goals)
    report = {"drafter": str(args.drafter), "goals": goals, "points": pts, "fits": fit}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    js, png = args.out.with_suffix(".json"), args.out.with_suffix(".png")
    tmp = js.with_name(js.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(js)
    _plot(pts, fit, args.block_size, goals, png)
    print(table(pts, fit, goals))
    print(f"wrote {js} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
