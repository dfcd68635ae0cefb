"""`dflash plot RUN_DIR`: PNG training curves from metrics.jsonl.

One figure per quantity a user reads first: loss, in-batch acceptance (exact and
expected tau, the lk term's expected tau at temperature 1, plus the measured and walked held-out
tau of in-training evals when present), per-slot accuracy at the last log, learning rate and
throughput; for DFlash2 the selector walk against the backbone and the top-K ceiling, the
candidates' recall and both losses.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

from dflash_trainer.atomic_dir import write_file_atomic
from dflash_trainer.errors import DFlashError
from dflash_trainer.json_input import is_number
from dflash_trainer.train.run_dir import read_metrics, series


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a training run directory (holds metrics.jsonl)")
    p.add_argument("--out", help="output folder (default RUN_DIR/plots)")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """The PNG curves of RUN/metrics.jsonl, into `out` (default RUN/plots). A row of the
    wrong shape is left out of a curve (run_dir.series), never a crash."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(run_dir)
    train = [r for r in recs if is_number(r.get("loss"))]
    evals = [r for r in recs if is_number(r.get("eval_tau"))]
    if not train:
        raise DFlashError(f"{run_dir}: no training metrics (metrics.jsonl is missing or empty)")
    out_dir = Path(out) if out else Path(run_dir) / "plots"
    if out is None and (out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir())):
        # The run's own plots folder: a link out of the run is not written through.
        raise DFlashError(f"{out_dir} is not a directory of the run (a link or a file); move it "
                          "away, or give --out")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Any, name: str) -> None:
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, dpi=120, format="png")
        plt.close(fig)
        written.append(write_file_atomic(out_dir / name, buf.getvalue()))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*series(train, "loss"), label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    save(fig, "loss.png")

    save(_tau_figure(plt, train, evals), "tau.png")

    last = train[-1].get("slot_acc")
    if isinstance(last, list) and last and all(is_number(v) for v in last):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(range(1, len(last) + 1), last)
        ax.set_xlabel("slot k")
        ax.set_ylabel("accuracy")
        ax.set_title(f"per-slot accuracy at step {train[-1].get('step')}")
        save(fig, "slot_accuracy.png")

    if any("selector_tau" in r for r in train):
        save(*_dflash2_figure(plt, train), "dflash2.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    a1.plot(*series(train, "lr"))
    a1.set_title("learning rate")
    a1.set_xlabel("step")
    a2.plot(*series(train, "tokens_per_s"))
    a2.set_title("tokens/s")
    a2.set_xlabel("step")
    save(fig, "lr_throughput.png")
    return written


def _tau_figure(plt: Any, train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> Any:
    """In-batch, expected, measured and walked acceptance against the step."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*series(train, "exact_tau"), label="in-batch tau (exact)")
    ax.plot(*series(train, "expected_tau"), label="expected tau (from slot acc.)", ls="--")
    if evals:
        name = evals[0].get("eval_set", "eval")
        ax.plot(*series(evals, "eval_tau"), "o-", label=f"measured tau ({str(name)[:40]})")
        walks = series(evals, "heldout_walk_tau")
        if walks[0]:  # served acceptance on held-out training-distribution documents
            ax.plot(*walks, "s-", label="walked held-out tau")
    lk = series(train, "lk_tau")
    if lk[0]:  # expected tau at temperature 1 (lk term)
        ax.plot(*lk, ls=":", label="E[tau] at t=1")
    ax.set_xlabel("step")
    ax.set_ylabel("acceptance length")
    ax.set_title("acceptance")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _dflash2_figure(plt: Any, train: list[dict[str, Any]]) -> tuple[Any]:
    """DFlash2: the selector's walk against the backbone's argmax and the top-K ceiling, the
    candidates' recall, and the two losses."""
    rows = [r for r in train if "selector_tau" in r]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.4))
    a1.plot(*series(rows, "selector_tau"), label="selector walk")
    a1.plot(*series(rows, "exact_tau"), label="backbone argmax")
    a1.plot(*series(rows, "oracle_tau"), ls="--", label="oracle over top-K")
    a1.set_title("in-batch acceptance (tau)")
    a1.legend()
    a2.plot(*series(rows, "candidate_recall"))
    a2.set_title("candidate recall@K")
    a3.plot(*series(rows, "base_loss"), label="block loss")
    a3.plot(*series(rows, "selector_loss"), label="selector loss")
    a3.set_title("losses")
    a3.legend()
    for ax in (a1, a2, a3):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return (fig,)


def run(args: argparse.Namespace) -> int:
    for p in plot_run(args.run_dir, args.out):
        print(p)
    return 0
