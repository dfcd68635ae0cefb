"""What a run writes of its drafter: checkpoints (`save_checkpoint`), the final drafter
with its lineage (`write_final_drafter`) and the plots of its metrics (`write_plots`).

The loop (train/trainer.py) decides when; this module holds what each write takes from the
trainer, and the refusals that keep a good checkpoint from being replaced by a bad one.
train/train_state.py says what a checkpoint holds, train/checkpoint.py how it is stored.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dflash_trainer.config import config_to_dict
from dflash_trainer.core.dflash2 import serving_state
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.errors import DFlashError
from dflash_trainer.lineage.training import Inheritance, files_for_run
from dflash_trainer.train import distributed as D
from dflash_trainer.train import train_state
from dflash_trainer.train.checkpoint import Checkpointer
from dflash_trainer.train.train_state import capture_state, full_states, run_meta


class Trainer(train_state.Trainer, Protocol):
    """What the writes read of the trainer beyond its state (a protocol: trainer.py imports
    this module, not the other way round)."""

    @property
    def drafter(self) -> DFlashDrafter: ...
    @property
    def checkpointer(self) -> Checkpointer: ...
    @property
    def inherited(self) -> Inheritance: ...
    def _log(self, msg: str) -> None: ...


def save_checkpoint(tr: Trainer) -> str | None:
    """Checkpoint `tr` now (a collective: every rank calls); its location on rank 0, None on
    the others. Non-finite weights are refused rather than saved over the last good one."""
    state, optim_state = full_states(tr)
    if not tr.world.is_main:
        D.broadcast_object(None, tr.world)
        return None
    if not all(bool(torch.isfinite(v).all()) for v in state.values()):
        raise DFlashError(
            f"step {tr.step}: the drafter has non-finite weights; refusing to overwrite "
            f"the last good checkpoint ({tr.checkpointer.latest() or 'none'})"
        )
    loc = tr.checkpointer.save(capture_state(tr, state, optim_state))
    D.broadcast_object(loc, tr.world)
    return loc


def write_final_drafter(tr: Trainer) -> None:
    """RUN/drafter: the published layout, meta.json and the lineage (every rank calls: the
    full state is a collective under FSDP; rank 0 writes)."""
    state, _ = full_states(tr)
    if not tr.world.is_main:
        return
    from dflash_trainer.formats.drafter_io import write_drafter_dir

    state, _ = serving_state(state, tr.drafter.candidate_selector)
    lineage = files_for_run(tr, state, config_to_dict(tr.cfg))
    write_drafter_dir(tr.run_dir / "drafter", tr.spec, state, run_meta(tr), lineage)
    tr._log(f"final drafter written to {tr.run_dir / 'drafter'}")


def write_plots(tr: Trainer) -> None:
    """The metrics plots, on rank 0; a run that cannot plot them (no matplotlib, no metrics
    rows, a plots path that is not a directory) says so and still finishes."""
    if not tr.world.is_main:
        return
    from dflash_trainer.train.plots import plot_run

    try:
        plot_run(tr.run_dir)
    except (DFlashError, ImportError, OSError) as e:
        tr._log(f"plots not written: {e}")
