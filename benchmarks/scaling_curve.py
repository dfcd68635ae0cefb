"""What more data buys: served tau against training-set size, and against steps of one run.

Reads runs of the same recipe trained on nested subsets of one regenerated set (each with a
`dflash eval` report at t=0), the served evaluations of the largest run's kept checkpoints
(`--step-evals`: step_<N>/eval.json) and its in-training evaluations when it logged any
(`metrics.jsonl`), and writes one JSON, one Markdown table and one plot with both curves.
Sizes are counted in assistant turns when `--samples` (benchmarks/sample_records.py) names
every run's label, else in conversations.

    python benchmarks/scaling_curve.py --run 4000=OUT/r4000 --run 12000=OUT/r12000 \\
        --run all=HEADLINE/run --eval-dir all=HEADLINE/t0 --step-evals HEADLINE/steps \\
        --samples OUT/samples.json --out OUT/scaling
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _prepared(run: Path) -> dict[str, int]:
    """Training documents (conversations) and tokens, from the run's prepared data manifest."""
    import yaml

    path = run / "config.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.exists() else {}
    train = ((cfg or {}).get("data") or {}).get("train")
    manifest = Path(str(train)) / "manifest.json" if train else None
    if manifest is None or not manifest.exists():
        return {"documents": 0, "supervised_tokens": 0}
    split = json.loads(manifest.read_text()).get("splits", {}).get("train") or {}
    return {k: int(split.get(k, 0)) for k in ("documents", "supervised_tokens")}


def _final_step(run: Path) -> int | None:
    latest = run / "checkpoints" / "LATEST"
    if not latest.exists():
        return None
    return int(latest.read_text().strip().rpartition("_")[2])


def _step_points(step_evals: Path | None, full: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Served tau of each kept checkpoint of the largest run, then of its final drafter."""
    final = _final_step(Path(full["run"])) if full is not None and full["tau"] else None
    rows = []
    for d in sorted(step_evals.glob("step_*")) if step_evals else []:
        tau, step = _eval(d), int(d.name.rpartition("_")[2])
        if tau and step != final:  # the final checkpoint's point is the run's own report
            rows.append({"step": step, "tau": tau})
    if final is not None and full is not None:
        rows.append({"step": final, "tau": full["tau"]})
    return sorted(rows, key=lambda r: r["step"])


def _eval(eval_dir: Path) -> dict[str, float]:
    path = eval_dir / "eval.json"
    if not path.exists():
        return {}
    sets = json.loads(path.read_text())["sets"]
    return {name: float(s["tau"]) for name, s in sets.items()}


def _curve(run: Path) -> list[dict[str, Any]]:
    rows = []
    metrics = run / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        rec = json.loads(line)
        if "eval_tau" in rec:
            rows.append(
                {k: rec.get(k) for k in ("step", "eval_set", "eval_tau", "heldout_walk_tau")}
            )
    return rows


def _plot(
    points: list[dict[str, Any]],
    steps: list[dict[str, Any]],
    curve: list[dict[str, Any]],
    out: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = sorted({k for p in points for k in p["tau"]})
    for name in names:
        have = [p for p in points if name in p["tau"]]
        a.plot([p["x"] for p in have], [p["tau"][name] for p in have], "o-", label=name)
    if any(p["x"] > 0 for p in points):
        a.set_xscale("log")
    a.set(xlabel=f"training set ({points[0]['x_unit']})", ylabel="served tau (t=0)")
    a.set_title("tau against training-set size")
    a.legend()
    for name in sorted({k for r in steps for k in r["tau"]}):
        have = [r for r in steps if name in r["tau"]]
        b.plot([r["step"] for r in have], [r["tau"][name] for r in have], "o-", label=name)
    if curve:
        xs = [r["step"] for r in curve]
        b.plot(
            xs, [r["eval_tau"] for r in curve], "x:", label=f"{curve[0]['eval_set']} (in-training)"
        )
        if any(r["heldout_walk_tau"] is not None for r in curve):
            b.plot(xs, [r["heldout_walk_tau"] for r in curve], "s--", label="held-out walk")
    b.set(xlabel="step", ylabel="served tau (t=0)", title="tau against steps (largest run)")
    if steps or curve:
        b.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def _table(points: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[str]:
    names = sorted({k for q in points + steps for k in q["tau"]})

    def taus(q: dict[str, Any]) -> str:
        return " | ".join(f"{q['tau'][n]:.2f}" if n in q["tau"] else "-" for n in names)

    lines = [
        "| run | conversations | assistant turns | supervised tokens | " + " | ".join(names) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(names),
    ]
    for q in points:
        turns = f"{q['assistant_turns']:,}" if q["assistant_turns"] else "-"
        lines.append(
            f"| {q['label']} | {q['documents']:,} | {turns} | {q['supervised_tokens']:,} | {taus(q)} |"
        )
    if steps:
        lines += ["", "| step (largest run) | " + " | ".join(names) + " |"]
        lines.append("|---:|" + "---:|" * len(names))
        lines += [f"| {r['step']} | {taus(r)} |" for r in steps]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", required=True, help="LABEL=RUN_DIR (eval under it)")
    p.add_argument("--eval-name", default="t0", help="the eval report's folder in each run dir")
    p.add_argument("--eval-dir", action="append", default=[], help="LABEL=DIR: eval elsewhere")
    p.add_argument(
        "--samples", type=Path, help="sample_records.py's samples.json (turns per label)"
    )
    p.add_argument("--step-evals", type=Path, help="step_<N>/ eval reports of the largest run")
    p.add_argument("--out", type=Path, required=True, help="folder for scaling.{json,md,png}")
    args = p.parse_args(argv)
    elsewhere = dict(item.partition("=")[::2] for item in args.eval_dir)
    samples = json.loads(args.samples.read_text()) if args.samples and args.samples.exists() else {}
    points = []
    for item in args.run:
        label, _, where = item.partition("=")
        run = Path(where)
        ev = Path(elsewhere[label]) if label in elsewhere else run / args.eval_name
        turns = int((samples.get(label) or {}).get("assistant_turns", 0))
        points.append({"label": label, "run": where, **_prepared(run), "assistant_turns": turns})
        points[-1]["tau"] = _eval(ev)
    by_turns = all(q["assistant_turns"] for q in points)
    for q in points:
        q["x"], q["x_unit"] = (
            (q["assistant_turns"], "assistant turns")
            if by_turns
            else (q["documents"], "conversations")
        )
    points.sort(key=lambda q: q["x"])
    largest = points[-1] if points else None
    steps = _step_points(args.step_evals, largest)
    curve = _curve(Path(largest["run"])) if largest else []
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"sizes": points, "steps": steps, "in_training": curve}
    (args.out / "scaling.json").write_text(json.dumps(result, indent=1))
    lines = _table(points, steps)
    (args.out / "scaling.md").write_text("\n".join(lines) + "\n")
    _plot(points, steps, curve, args.out / "scaling.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
