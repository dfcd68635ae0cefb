"""`dflash plot RUN_DIR`: PNG training curves from metrics.jsonl.

One figure per quantity a user reads first: loss, in-batch acceptance (exact and
expected tau, the lk term's expected tau at temperature 1, plus the measured and walked held-out
tau of in-training evals when present), per-slot accuracy at the last log, learning rate and
throughput; for DFlash2 the selector walk against the backbone and the top-K ceiling, the
candidates' recall and both losses.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dflash_trainer.errors import DFlashError
from dflash_trainer.train.run_dir import read_metrics


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a training run directory (holds metrics.jsonl)")
    p.add_argument("--out", help="output folder (default RUN_DIR/plots)")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(run_dir)
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_tau" in r]
    if not train:
        raise DFlashError(f"{run_dir}: no training metrics (metrics.jsonl is missing or empty)")
    out_dir = Path(out) if out else Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in train]
    written = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["loss"] for r in train], label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    save(fig, "loss.png")

    save(_tau_figure(plt, train, evals), "tau.png")

    last = train[-1].get("slot_acc") or []
    if last:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(range(1, len(last) + 1), last)
        ax.set_xlabel("slot k")
        ax.set_ylabel("accuracy")
        ax.set_title(f"per-slot accuracy at step {train[-1]['step']}")
        save(fig, "slot_accuracy.png")

    if any("selector_tau" in r for r in train):
        save(*_dflash2_figure(plt, train), "dflash2.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    a1.plot(steps, [r["lr"] for r in train])
    a1.set_title("learning rate")
    a1.set_xlabel("step")
    a2.plot(steps, [r["tokens_per_s"] for r in train])
    a2.set_title("tokens/s")
    a2.set_xlabel("step")
    save(fig, "lr_throughput.png")
    return written


def _tau_figure(plt: Any, train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> Any:
    """In-batch, expected, measured and walked acceptance against the step."""
    steps = [r["step"] for r in train]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["exact_tau"] for r in train], label="in-batch tau (exact)")
    ax.plot(
        steps, [r["expected_tau"] for r in train], label="expected tau (from slot acc.)", ls="--"
    )
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_tau"] for r in evals],
            "o-",
            label=f"measured tau ({evals[0].get('eval_set', 'eval')})",
        )
        walks = [r for r in evals if r.get("heldout_walk_tau") is not None]
        if walks:  # served acceptance on held-out training-distribution documents
            ax.plot(
                [r["step"] for r in walks],
                [r["heldout_walk_tau"] for r in walks],
                "s-",
                label="walked held-out tau",
            )
    if any("lk_tau" in r for r in train):  # expected tau at temperature 1 (lk term)
        lk = [r for r in train if "lk_tau" in r]
        ax.plot([r["step"] for r in lk], [r["lk_tau"] for r in lk], ls=":", label="E[tau] at t=1")
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
    steps = [r["step"] for r in rows]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.4))
    a1.plot(steps, [r["selector_tau"] for r in rows], label="selector walk")
    a1.plot(steps, [r["exact_tau"] for r in rows], label="backbone argmax")
    a1.plot(steps, [r["oracle_tau"] for r in rows], ls="--", label="oracle over top-K")
    a1.set_title("in-batch acceptance (tau)")
    a1.legend()
    a2.plot(steps, [r["candidate_recall"] for r in rows])
    a2.set_title("candidate recall@K")
    a3.plot(steps, [r["base_loss"] for r in rows], label="block loss")
    a3.plot(steps, [r["selector_loss"] for r in rows], label="selector loss")
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
