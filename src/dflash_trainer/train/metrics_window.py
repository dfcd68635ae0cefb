"""One metrics row per logging window: the steps since the last row, averaged.

`window_record` turns the `StepStats` of the steps since the last row into the row the
trainer writes to metrics.jsonl (and TensorBoard); `console_line` is its one-line form.
Kept apart from the loop so that what a row holds is read in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from dflash_trainer.train.batching import Position
from dflash_trainer.train.distributed import World

if TYPE_CHECKING:
    from dflash_trainer.train.stepping import StepStats


class Trainer(Protocol):
    """What a metrics row reads of the trainer (a protocol: trainer.py imports this module,
    not the other way round)."""

    @property
    def world(self) -> World: ...
    @property
    def position(self) -> Position: ...
    @property
    def batcher(self) -> Any: ...
    @property
    def scheduler(self) -> Any: ...
    @property
    def step(self) -> int: ...
    @property
    def tokens_seen(self) -> int: ...
    @property
    def truncated_total(self) -> int: ...
    @property
    def skipped_total(self) -> int: ...


PER_BLOCK_METRICS = frozenset({"exact_tau", "selector_tau", "oracle_tau", "lk_tau"})
"""Metrics that are means over blocks (weighed by anchors when steps are averaged)."""

OPTIONAL_METRICS = (
    "base_loss",
    "lk_loss",
    "lk_tau",
    "selector_loss",
    "candidate_recall",
    "selector_accuracy",
    "selector_tau",
    "oracle_tau",
)
"""Logged when the objective computes them: the lk term, DFlash2's selector term."""


def window_record(tr: Trainer, window: list[StepStats]) -> dict[str, Any]:
    """The metrics row of `window` (skipped steps count in the time, not in the means)."""
    ok = [s for s in window if not s.skipped] or window
    n = len(ok)
    dt = sum(s.target_s + s.drafter_s for s in window)
    m = {k: sum(s.metrics[k] for s in ok) / n for k in ok[0].metrics}
    # Per-block means: weigh each step by its anchors (a step may have none).
    n_anchors = sum(float(s.metrics["anchors"]) for s in ok)
    if n_anchors > 0:
        for key in PER_BLOCK_METRICS & set(m):
            m[key] = sum(s.metrics[key] * s.metrics["anchors"] for s in ok) / n_anchors
    world = tr.world.world_size
    rec: dict[str, Any] = {
        "step": tr.step,
        "epoch": tr.position.epoch + tr.position.step / max(1, tr.batcher.steps_per_epoch),
        "loss": sum(s.loss for s in ok) / n,
        "accuracy": float(m["accuracy"]),
        "exact_tau": float(m["exact_tau"]),
        "expected_tau": float(m["expected_tau"]),
        "slot_acc": [round(float(x), 5) for x in m["slot_acc"]],
        "lr": tr.scheduler.get_last_lr()[0],
        "grad_norm": sum(s.grad_norm for s in ok) / n,
        "tokens_per_s": sum(s.tokens for s in window) / max(dt, 1e-9) * world,
        "step_time_s": dt / len(window),
        "target_time_s": sum(s.target_s for s in window) / len(window),
        "drafter_time_s": sum(s.drafter_s for s in window) / len(window),
        "valid_slots": float(m["valid_slots"]),
        "tokens_seen": tr.tokens_seen * world,
        "truncated_docs": tr.truncated_total,
        "skipped_steps": tr.skipped_total,
    }
    # The terms beside the block loss, when the objective has them (lk, DFlash2).
    for key in OPTIONAL_METRICS:
        if key in m:
            rec[key] = float(m[key])
    if tr.world.drafter_device.type == "cuda":
        rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(tr.world.drafter_device) / 1e9
    return rec


def console_line(rec: dict[str, Any]) -> str:
    """The row as the console shows it every tenth logging window."""
    return (
        f"step {rec['step']}: loss {rec['loss']:.4f} acc {rec['accuracy']:.3f} "
        f"tau {rec['exact_tau']:.2f}{selector_note(rec)} lr {rec['lr']:.2e} "
        f"{rec['tokens_per_s']:.0f} tok/s"
    )


def selector_note(rec: dict[str, Any]) -> str:
    """DFlash2: the selector path's tau beside the backbone's, and the candidates' recall."""
    if "selector_tau" not in rec:
        return ""
    return (
        f" (selector {rec['selector_tau']:.2f}, oracle top-K {rec['oracle_tau']:.2f}, "
        f"recall {rec['candidate_recall']:.3f})"
    )
