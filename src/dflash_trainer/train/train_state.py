"""The trainer's state into a checkpoint and back out of it: weights, optimizer, schedule,
data position, counters and RNG (`capture_state` / `restore_state`), and `run_meta`, what
trained a checkpoint or a final drafter. train/checkpoint.py stores and checks the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from dflash_trainer.config import Config
from dflash_trainer.core.dflash2 import (
    CandidateSelector,
    DamagedFactors,
    serving_state,
    training_state,
)
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.safetensors_check import check_finite
from dflash_trainer.train.batching import Position, TokenBudgetBatcher
from dflash_trainer.train.checkpoint import CheckpointData, CheckpointState
from dflash_trainer.train.distributed import World


class Trainer(Protocol):
    """What capture_state / restore_state touch of the trainer (a protocol: trainer.py
    imports this module, not the other way round). Read-only parts are properties."""

    @property
    def cfg(self) -> Config: ...
    @property
    def world(self) -> World: ...
    @property
    def spec(self) -> DrafterSpec: ...
    @property
    def run_dir(self) -> Path: ...
    @property
    def data(self) -> Any: ...
    @property
    def drafter(self) -> torch.nn.Module: ...
    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler: ...
    @property
    def anchor_gen(self) -> torch.Generator: ...
    @property
    def total_steps(self) -> int: ...
    @property
    def batcher(self) -> TokenBudgetBatcher: ...
    def _warn(self, msg: str) -> None: ...

    step: int
    micro_steps: int
    position: Position
    bad_steps: int
    skipped_total: int
    truncated_total: int
    tokens_seen: int


def run_meta(tr: Trainer) -> dict[str, Any]:
    """meta.json of a checkpoint and of the final drafter: what trained it."""
    from dflash_trainer.config import config_to_dict

    return {
        "step": tr.step,
        "target": config_to_dict(tr.cfg.target),
        "drafter": config_to_dict(tr.cfg.drafter),
        "training": config_to_dict(tr.cfg.training),
        "data": config_to_dict(tr.cfg.data),
        "prepared": prepared_meta(getattr(tr.data.train, "manifest", None) if tr.data else None),
        "run": str(tr.run_dir),
    }


def prepared_meta(manifest: Any) -> dict[str, Any] | None:
    """How the training documents were prepared (`dflash data prepare` settings, loop tails,
    train split size): a prepared directory's settings are not in the run's config."""
    if not isinstance(manifest, dict):
        return None
    train = manifest.get("splits", {}).get("train", {})
    return {
        "fingerprint": manifest.get("fingerprint"),
        "settings": manifest.get("settings"),
        "loop_tails": manifest.get("loop_tails"),
        "train": {k: train.get(k) for k in ("documents", "tokens", "supervised_tokens")},
    }


def _fsdp_drafter(tr: Trainer) -> bool:
    return tr.world.distributed and tr.cfg.distributed.data_parallel == "fsdp"


def _selector(tr: Trainer) -> CandidateSelector | None:
    sel = getattr(tr.drafter, "candidate_selector", None)
    return sel if isinstance(sel, CandidateSelector) else None


def full_states(tr: Trainer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Unsharded model and optimizer state (a collective under FSDP: every rank calls)."""
    if not _fsdp_drafter(tr):
        return tr.drafter.state_dict(), tr.optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd: Any = get_model_state_dict(tr.model, options=opts)
    optim_sd: Any = get_optimizer_state_dict(tr.model, tr.optimizer, options=opts)
    return model_sd, optim_sd


def capture_state(
    tr: Trainer, drafter_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
) -> CheckpointState:
    """What a checkpoint of `tr` holds: weights, optimizer, schedule, data position, RNG."""
    # Anchors and noise are re-seeded per step (Trainer._stream_seed); the generator
    # states are kept for inspection only.
    rng = {"torch_cpu": torch.get_rng_state(), "anchor_gen": tr.anchor_gen.get_state()}
    trainer_state = {
        "step": tr.step,
        "micro_steps": tr.micro_steps,
        "position": {"epoch": tr.position.epoch, "step": tr.position.step},
        "scheduler": tr.scheduler.state_dict(),
        "bad_steps": tr.bad_steps,
        "skipped_total": tr.skipped_total,
        "truncated_total": tr.truncated_total,
        "tokens_seen": tr.tokens_seen,
        "world_size": tr.world.world_size,
        "total_steps": tr.total_steps,
        "left_out_docs": tr.batcher.unsupervised()[0],
    }
    # The drafter file holds the published layout (tables) whatever the selector trains;
    # an embedding-mode selector's factors travel beside it for the resume.
    drafter_state, factors = serving_state(drafter_state, _selector(tr))
    return CheckpointState(
        tr.step,
        tr.spec,
        drafter_state,
        run_meta(tr),
        optimizer_state,
        trainer_state,
        rng,
        selector_factors=factors,
    )


_RESTORED = ("scheduler", "bad_steps", "skipped_total", "truncated_total", "tokens_seen")


def restore_state(tr: Trainer, data: CheckpointData) -> None:
    """Put a loaded checkpoint back into `tr` (the inverse of capture_state)."""
    ts = data.trainer_state
    lacking = [k for k in _RESTORED if k not in ts]
    if lacking:
        raise DFlashError(
            f"{data.location}/trainer_state.json lacks {', '.join(lacking)}: it was not "
            "written by this trainer; resume from another checkpoint (step_XXXXXXXX)"
        )
    if ts.get("world_size", 1) != tr.world.world_size:
        raise DFlashError(
            f"{data.location} was written by a run with {ts['world_size']} ranks; this run "
            f"has {tr.world.world_size}. Resume with the same number of ranks (the data "
            "order and anchor streams are per rank)"
        )
    try:
        drafter_state = training_state(data.drafter_state, data.selector_factors, _selector(tr))
    except DamagedFactors as e:
        raise DFlashError(
            f"{data.location}: {e}; restore the checkpoint from a copy, or move it away to "
            "resume from an older one"
        ) from e
    except ValueError as e:
        raise DFlashError(
            f"{data.location}: {e}; resume with the drafter.selector_codebooks that wrote it"
        ) from e
    # NaN weights in a checkpoint (an edit with its checksums removed, a run that saved after
    # a blow-up) would make every later step non-finite, and that error blames the data.
    check_finite(drafter_state, data.location)
    if _fsdp_drafter(tr):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        full: Any = drafter_state
        set_model_state_dict(tr.model, full, options=opts)
        set_optimizer_state_dict(tr.model, tr.optimizer, data.optimizer_state, options=opts)
    else:
        try:
            tr.drafter.load_state_dict(drafter_state)
            tr.optimizer.load_state_dict(data.optimizer_state)
        except (RuntimeError, ValueError, KeyError) as e:
            raise DFlashError(
                f"{data.location}: its weights or optimizer state do not fit this run's "
                f"drafter ({str(e)[:300]}); resume with the config that wrote it"
            ) from e
    tr.scheduler.load_state_dict(ts["scheduler"])
    tr.step = ts["step"]
    # Older checkpoints: no step was ever skipped as empty, so micro-steps = steps x accum.
    tr.micro_steps = ts.get("micro_steps", ts["step"] * tr.cfg.training.grad_accum_steps)
    tr.position = Position(**ts["position"])
    tr.bad_steps = ts["bad_steps"]
    tr.skipped_total = ts["skipped_total"]
    tr.truncated_total = ts["truncated_total"]
    tr.tokens_seen = ts["tokens_seen"]
    _say_plan_change(tr, ts.get("left_out_docs"), data.location)


def _say_plan_change(tr: Trainer, saved: int | None, where: str) -> None:
    """The same data cut into other steps: a checkpoint of a version that kept documents that
    supervise nothing in the epoch (no count recorded), or one that left out another number."""
    now = tr.batcher.unsupervised()[0]
    if saved == now or (saved is None and not now):
        return
    before = "kept them in its epochs" if saved is None else f"left out {saved:,}"
    tr._warn(
        f"{where} was written by a run that {before}; this one leaves out {now:,} documents "
        "that supervise nothing within data.max_doc_tokens: the rest of the run sees its "
        "documents in another order than an uninterrupted run would (same data, same schedule)"
    )
