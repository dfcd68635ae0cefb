"""What more data buys: served tau against training-set size, and against steps of one run.

Reads runs of the same recipe trained on nested subsets of one regenerated set (each with a
`dflash eval` report at t=0), the served evaluations of the largest run's kept checkpoints
(`--step-evals`: step_<N>/eval.json) and its in-training evaluations when it logged any
(`metrics.jsonl`), and writes one JSON, one Markdown table and one plot with both curves.
Sizes are counted in assistant turns when `--samples` (benchmarks/sample_records.py) names
every run's label, else in conversations. `--point` adds a size point from an eval report alone
(a run kept only as results). With `--goal SET=TAU`, the size points are extrapolated to the
size at which that set's tau would reach the goal, under two models fitted by least squares:
the per-position acceptance rate a (tau = 1 + a + ... + a^(B-1), B the block size) logistic in
the log of the size, and tau itself linear in the log of the size. Two or three points cannot
tell the models apart: the two answers bracket what the curve says, they are no measurement.

    python benchmarks/scaling_curve.py --run 4000=OUT/r4000 --run 12000=OUT/r12000 \\
        --run all=HEADLINE/run --eval-dir all=HEADLINE/t0 --step-evals HEADLINE/steps \\
        --samples OUT/samples.json --out OUT/scaling
    python benchmarks/scaling_curve.py --point 10199=10199:r4000_t0_eval.json \
        --point 102927=102927:t0_gpu_gsm8k_eval.json --goal gsm8k=4.0 --out OUT/scaling
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def tau_of_alpha(alpha: float, block: int) -> float:
    """Served tau (accepted drafts plus the target's own token) when every drafted position is
    accepted with probability `alpha` once the ones before it are: 1 + a + ... + a^(block-1)."""
    return float(sum(alpha**k for k in range(block)))


def alpha_of_tau(tau: float, block: int) -> float:
    """The acceptance rate that gives `tau` (the inverse of tau_of_alpha, by bisection)."""
    if not 1.0 < tau < block:
        raise ValueError(f"tau {tau} is outside (1, {block}) for block size {block}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_of_alpha(mid, block) < tau else (lo, mid)
    return (lo + hi) / 2


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def _logit_alpha(tau: float, block: int) -> float:
    a = alpha_of_tau(tau, block)
    return math.log(a / (1 - a))


def predict(sizes: list[float], taus: list[float], goal: float, block: int) -> dict[str, Any]:
    """The size at which tau reaches `goal`, extrapolated from (size, tau) points under both
    models (module docstring); a model whose fit does not grow with size predicts nothing,
    and the acceptance model leaves out points at tau 1 or the block length (no finite logit).
    """
    out: dict[str, Any] = {"goal": goal, "points": len(sizes), "block_size": block}
    if not 1.0 < goal < block:
        out["why_none"] = f"the goal is outside (1, {block})"
        return out
    inside = [(x, t) for x, t in zip(sizes, taus) if 1.0 < t < block]
    fits = {
        "acceptance_logistic": (
            [(math.log(x), _logit_alpha(t, block)) for x, t in inside],
            _logit_alpha(goal, block),
        ),
        "tau_log_linear": ([(math.log(x), t) for x, t in zip(sizes, taus)], goal),
    }
    for name, (xy, target) in fits.items():
        if len({x for x, _ in xy}) < 2:
            out[name] = {"why_none": "fewer than two distinct sizes with a usable tau"}
            continue
        c, slope = _line([x for x, _ in xy], [y for _, y in xy])
        entry: dict[str, Any] = {"intercept": c, "slope": slope, "points": len(xy)}
        if slope > 0:
            entry["size_for_goal"] = math.exp((target - c) / slope)
        out[name] = entry
    return out


def fitted(model: str, fit: dict[str, float], size: float, block: int) -> float:
    """A fitted model's tau at `size`."""
    y = fit["intercept"] + fit["slope"] * math.log(size)
    if model == "tau_log_linear":
        return y
    return tau_of_alpha(1 / (1 + math.exp(-y)), block)


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
    for d in sorted(p for p in step_evals.glob("step_*") if p.is_dir()) if step_evals else []:
        tau, step = _eval(d), int(d.name.rpartition("_")[2])
        if tau and step != final:  # the final checkpoint's point is the run's own report
            rows.append({"step": step, "tau": tau})
    if final is not None and full is not None:
        rows.append({"step": final, "tau": full["tau"]})
    return sorted(rows, key=lambda r: r["step"])


def _eval(eval_dir: Path) -> dict[str, float]:
    """Tau per prompt set of a `dflash eval` report (its folder, or its eval.json itself)."""
    path = eval_dir if eval_dir.suffix == ".json" else eval_dir / "eval.json"
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
    predictions: dict[str, dict[str, Any]],
    block: int,
    out: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    both = bool(steps or curve)
    fig, axes = plt.subplots(1, 2 if both else 1, figsize=(11 if both else 6, 4), squeeze=False)
    a = axes[0][0]
    names = sorted({k for p in points for k in p["tau"]})
    for name in names:
        have = [p for p in points if name in p["tau"]]
        line = a.plot([p["x"] for p in have], [p["tau"][name] for p in have], "o-", label=name)
        _extrapolate(a, have, predictions.get(name), block, line[0].get_color())
    if any(p["x"] > 0 for p in points):
        a.set_xscale("log")
    a.set(xlabel=f"training set ({points[0]['x_unit']})", ylabel="served tau (t=0)")
    a.set_title("tau against training-set size")
    if predictions:
        a.plot([], [], "k--", lw=1, label="fit: acceptance logistic in log size")
        a.plot([], [], "k:", lw=1, label="fit: tau linear in log size")
    a.legend(fontsize=8)
    if both:
        _plot_steps(axes[0][1], steps, curve)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def _plot_steps(b: Any, steps: list[dict[str, Any]], curve: list[dict[str, Any]]) -> None:
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
    b.legend()


def _extrapolate(
    ax: Any, have: list[dict[str, Any]], pred: dict[str, Any] | None, block: int, color: str
) -> None:
    """Both fitted models from the smallest point to the size they predict for the goal."""
    if not pred or not have:
        return
    for model, style in (("acceptance_logistic", "--"), ("tau_log_linear", ":")):
        fit = pred.get(model) or {}
        if "size_for_goal" not in fit:
            continue
        lo, hi = math.log(have[0]["x"]), math.log(max(fit["size_for_goal"], have[-1]["x"]))
        xs = [math.exp(lo + (hi - lo) * i / 40) for i in range(41)]
        ax.plot(xs, [fitted(model, fit, x, block) for x in xs], style, color=color, lw=1)
    ax.axhline(pred["goal"], color=color, lw=0.5, alpha=0.5)


def _count(n: int) -> str:
    return f"{n:,}" if n else "-"


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
            f"| {q['label']} | {_count(q['documents'])} | {turns} | "
            f"{_count(q['supervised_tokens'])} | {taus(q)} |"
        )
    if steps:
        lines += ["", "| step (largest run) | " + " | ".join(names) + " |"]
        lines.append("|---:|" + "---:|" * len(names))
        lines += [f"| {r['step']} | {taus(r)} |" for r in steps]
    return lines


def _points(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Size points: the runs (prepared manifests, eval under the run or elsewhere), then the
    bare `--point`s (same label: their reports' sets merged)."""
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
    bare: dict[str, dict[str, Any]] = {}
    for item in args.point:
        label, _, rest = item.partition("=")
        turns, _, report = rest.partition(":")
        if not label or not turns.isdigit() or not Path(report).exists():
            raise SystemExit(f"--point {item!r}: use LABEL=TURNS:EVAL with an existing report")
        q = bare.setdefault(
            label,
            {"label": label, "run": None, "documents": 0, "supervised_tokens": 0, "tau": {}},
        )
        q["assistant_turns"] = int(turns)
        q["tau"].update(_eval(Path(report)))
    points += bare.values()
    by_turns = all(q["assistant_turns"] for q in points)
    for q in points:
        q["x"], q["x_unit"] = (
            (q["assistant_turns"], "assistant turns")
            if by_turns
            else (q["documents"], "conversations")
        )
    return sorted(points, key=lambda q: q["x"])


def _predictions(
    points: list[dict[str, Any]], goals: list[str], block: int
) -> dict[str, dict[str, Any]]:
    out = {}
    for item in goals:
        name, _, value = item.partition("=")
        have = [q for q in points if name in q["tau"] and q["x"] > 0]
        out[name] = predict(
            [q["x"] for q in have], [q["tau"][name] for q in have], float(value), block
        )
    return out


def _prediction_lines(predictions: dict[str, dict[str, Any]], unit: str) -> list[str]:
    if not predictions:
        return []
    lines = [
        "",
        f"| goal | points | {unit} for the goal: acceptance logistic in log size | "
        "tau linear in log size |",
        "|---|---:|---:|---:|",
    ]
    for name, p in predictions.items():
        sizes = [
            f"{p[m]['size_for_goal']:,.0f}" if "size_for_goal" in p.get(m, {}) else "-"
            for m in ("acceptance_logistic", "tau_log_linear")
        ]
        lines.append(f"| {name} tau {p['goal']:g} | {p['points']} | {sizes[0]} | {sizes[1]} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", default=[], help="LABEL=RUN_DIR (eval under it)")
    p.add_argument("--eval-name", default="t0", help="the eval report's folder in each run dir")
    p.add_argument("--eval-dir", action="append", default=[], help="LABEL=DIR: eval elsewhere")
    p.add_argument(
        "--point",
        action="append",
        default=[],
        help="LABEL=TURNS:EVAL (a report folder or eval.json): a size point without a run dir",
    )
    p.add_argument(
        "--samples", type=Path, help="sample_records.py's samples.json (turns per label)"
    )
    p.add_argument("--step-evals", type=Path, help="step_<N>/ eval reports of the largest run")
    p.add_argument(
        "--goal", action="append", default=[], help="SET=TAU: the size the curve predicts for it"
    )
    p.add_argument("--block-size", type=int, default=16, help="the drafters' block size")
    p.add_argument("--out", type=Path, required=True, help="folder for scaling.{json,md,png}")
    args = p.parse_args(argv)
    if not args.run and not args.point:
        p.error("name at least one --run or --point")
    points = _points(args)
    with_run = [q for q in points if q["run"] is not None]
    largest = with_run[-1] if with_run else None
    steps = _step_points(args.step_evals, largest)
    curve = _curve(Path(largest["run"])) if largest else []
    predictions = _predictions(points, args.goal, args.block_size)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"sizes": points, "steps": steps, "in_training": curve, "predictions": predictions}
    (args.out / "scaling.json").write_text(json.dumps(result, indent=1))
    lines = _table(points, steps) + _prediction_lines(predictions, points[0]["x_unit"])
    (args.out / "scaling.md").write_text("\n".join(lines) + "\n")
    _plot(points, steps, curve, predictions, args.block_size, args.out / "scaling.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
