"""The SmolLM2 sweep's table and plots from a sweep's output directory (gpu/train_sweep.sh).

    python benchmarks/sweep_table.py OUT_DIR [--plots DIR]

OUT_DIR holds `metrics_<run>.jsonl` (the trainer's log lines) and `eval_<tag>/eval.json`
(`dflash eval` reports; tag = run, or run_t0 / run_t1). Prints one Markdown table: per run
the steps trained, tokens seen, final in-batch numbers (mean of the last 4 log lines, to
smooth batch noise), and the measured tau / speedup / lossless check per prompt set.
With --plots, writes training curves of every run (loss, exact in-batch tau) and the
measured tau per run and prompt set.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

SETS = ("gsm8k", "mt-bench", "humaneval")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in row and "step" in row:
            rows.append(row)
    return rows


def tail_mean(rows: list[dict[str, Any]], key: str, n: int = 4) -> float:
    vals = [r[key] for r in rows[-n:] if isinstance(r.get(key), int | float)]
    return sum(vals) / len(vals) if vals else math.nan


def fmt(x: Any, digits: int = 2) -> str:
    if not isinstance(x, int | float) or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"


def eval_cells(report: dict[str, Any] | None) -> list[str]:
    cells = []
    for name in SETS:
        s = (report or {}).get("sets", {}).get(name)
        if not s:
            cells.append("-")
            continue
        lossless = s.get("lossless_mismatches")
        mark = "" if lossless in (None, 0) else f" ({lossless} mismatch)"
        cells.append(
            f"{fmt(s.get('tau'))} / {fmt(s.get('tau_pooled'))} / {fmt(s.get('speedup'))}x{mark}"
        )
    return cells


def load_eval(out: Path, tag: str) -> dict[str, Any] | None:
    path = out / f"eval_{tag}" / "eval.json"
    if not path.exists():
        return None
    report: dict[str, Any] = json.loads(path.read_text())
    return report


def table(out: Path) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    head = (
        "| run | temp | steps | tokens seen | loss | exact in-batch tau | slot-1 acc | "
        + " | ".join(f"{s} tau / pooled / speedup" for s in SETS)
        + " |"
    )
    lines = [head, "|" + "---|" * (7 + len(SETS))]
    curves: dict[str, list[dict[str, Any]]] = {}
    for mpath in sorted(out.glob("metrics_*.jsonl")):
        run = mpath.stem.removeprefix("metrics_")
        rows = read_metrics(mpath)
        if not rows:
            continue
        curves[run] = rows
        last = rows[-1]
        slot1 = [r["slot_acc"][0] for r in rows[-4:] if r.get("slot_acc")]
        common = [
            str(last["step"]),
            f"{last.get('tokens_seen', 0) / 1e6:.1f}M",
            fmt(tail_mean(rows, "loss")),
            fmt(tail_mean(rows, "exact_tau")),
            fmt(sum(slot1) / len(slot1) if slot1 else math.nan, 3),
        ]
        tags = [(run, "0")] if (out / f"eval_{run}").exists() else []
        tags += [(f"{run}_t{t}", t) for t in ("0", "1") if (out / f"eval_{run}_t{t}").exists()]
        for tag, temp in tags or [(run, "-")]:
            cells = eval_cells(load_eval(out, tag))
            lines.append("| " + " | ".join([run, temp, *common, *cells]) + " |")
    return "\n".join(lines), curves


def plots(out: Path, curves: dict[str, list[dict[str, Any]]], dest: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dest.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run, rows in sorted(curves.items()):
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["loss"] for r in rows], label=run, lw=1.2)
        axes[1].plot(steps, [r.get("exact_tau", math.nan) for r in rows], label=run, lw=1.2)
    axes[0].set(xlabel="step", ylabel="training loss", title="loss")
    axes[1].set(xlabel="step", ylabel="exact in-batch tau", title="in-batch acceptance")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    written.append(dest / "sweep_curves.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    tags = sorted(p.parent.name.removeprefix("eval_") for p in out.glob("eval_*/eval.json"))
    if tags:
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(tags)), 4))
        width = 0.8 / len(SETS)
        for k, name in enumerate(SETS):
            vals = []
            for tag in tags:
                s = (load_eval(out, tag) or {}).get("sets", {}).get(name) or {}
                vals.append(s.get("tau") or 0.0)
            ax.bar([i + k * width for i in range(len(tags))], vals, width, label=name)
        ax.set_xticks([i + width for i in range(len(tags))], tags, rotation=30, ha="right")
        ax.set(ylabel="measured tau (z-lab convention)", title="speculative decoding, H200")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(dest / "sweep_tau.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--plots", type=Path)
    args = p.parse_args()
    text, curves = table(args.out)
    print(text)
    if args.plots:
        for path in plots(args.out, curves, args.plots):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
