"""What more data buys: served tau against training-set size, and against steps of one run.

Reads runs of the same recipe trained on nested subsets of one regenerated set (each with a
`dflash eval` report at t=0) and the in-training evaluations of the largest run
(`metrics.jsonl`: measured tau on the first prompt set and the walked held-out tau), and
writes one JSON, one Markdown table and one plot with both curves.

    python benchmarks/scaling_curve.py --run 10k=OUT/r10k --run 30k=OUT/r30k \\
        --run full=HEADLINE/run --eval-dir full=HEADLINE/t0 --out OUT/scaling
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _turns(run: Path) -> int:
    """Training documents (conversations), from the manifest of the run's prepared data."""
    import yaml

    path = run / "config.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.exists() else {}
    train = ((cfg or {}).get("data") or {}).get("train")
    manifest = Path(str(train)) / "manifest.json" if train else None
    if manifest is None or not manifest.exists():
        return 0
    splits = json.loads(manifest.read_text()).get("splits", {})
    return int((splits.get("train") or {}).get("documents", 0))


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


def _plot(points: list[dict[str, Any]], curve: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = sorted({k for p in points for k in p["tau"]})
    for name in names:
        xs = [p["documents"] for p in points if name in p["tau"]]
        a.plot(xs, [p["tau"][name] for p in points if name in p["tau"]], "o-", label=name)
    if any(p["documents"] > 0 for p in points):
        a.set_xscale("log")
    a.set(xlabel="training documents (conversations)", ylabel="served tau (t=0)")
    a.set_title("tau against training-set size")
    a.legend()
    if curve:
        steps = [r["step"] for r in curve]
        b.plot(
            steps, [r["eval_tau"] for r in curve], "o-", label=f"{curve[0]['eval_set']} (served)"
        )
        if any(r["heldout_walk_tau"] is not None for r in curve):
            b.plot(steps, [r["heldout_walk_tau"] for r in curve], "s--", label="held-out walk")
    b.set(xlabel="step", ylabel="tau", title="tau against steps (largest run)")
    if curve:
        b.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", required=True, help="LABEL=RUN_DIR (eval under it)")
    p.add_argument("--eval-name", default="t0", help="the eval report's folder in each run dir")
    p.add_argument("--eval-dir", action="append", default=[], help="LABEL=DIR: eval elsewhere")
    p.add_argument("--out", type=Path, required=True, help="folder for scaling.{json,md,png}")
    args = p.parse_args(argv)
    elsewhere = dict(item.partition("=")[::2] for item in args.eval_dir)
    points = []
    for item in args.run:
        label, _, where = item.partition("=")
        run = Path(where)
        ev = Path(elsewhere[label]) if label in elsewhere else run / args.eval_name
        points.append({"label": label, "run": where, "documents": _turns(run), "tau": _eval(ev)})
    points.sort(key=lambda q: q["documents"])
    curve = _curve(Path(points[-1]["run"])) if points else []
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps({"sizes": points, "steps": curve}, indent=1))
    names = sorted({k for q in points for k in q["tau"]})
    lines = ["| run | documents | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for q in points:
        taus = " | ".join(f"{q['tau'][n]:.2f}" if n in q["tau"] else "-" for n in names)
        lines.append(f"| {q['label']} | {q['documents']:,} | {taus} |")
    (args.out / "scaling.md").write_text("\n".join(lines) + "\n")
    _plot(points, curve, args.out / "scaling.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
