"""A new run's drafter weights: its own initialisation, or a published or exported drafter's."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dflash_trainer.core.dflash2 import is_dflash2_tensor
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.core.geometry import DrafterSpec, init_differences
from dflash_trainer.errors import DFlashError


def new_drafter(
    spec: DrafterSpec,
    noise_std: float,
    codebooks: str,
    embedding_VH: torch.Tensor,
    device: torch.device,
) -> DFlashDrafter:
    """A freshly initialised drafter of `spec`; an embedding-mode DFlash2 selector gets its
    copy of the target's input embedding on `device` (tables need none, so none is made)."""
    drafter = DFlashDrafter(spec, noise_std=noise_std, selector_codebooks=codebooks)
    sel = drafter.candidate_selector
    if sel is not None and sel.codebooks == "embedding":
        sel.attach_embedding(embedding_VH.to(device))
    return drafter


def init_output_norm(drafter: DFlashDrafter, lm_head_weight: torch.Tensor) -> None:
    """Scale the drafter's final norm so its first logits have unit spread.

    Logits are the target's lm_head applied to norm(h). With a unit norm weight the
    random first outputs come out as confident as the lm_head's scale allows (SmolLM2:
    initial CE ~23 against ~11 for uniform), and the first steps are spent only
    shrinking that scale. With weight c = 1 / (std(lm_head) * sqrt(H)) a random
    direction gives logits of std ~1: the loss starts near log(V).
    """
    w = lm_head_weight.float()
    c = 1.0 / (float(w.std()) * math.sqrt(w.shape[1]))
    with torch.no_grad():
        drafter.norm.weight.fill_(c)


def init_drafter_from(
    drafter: DFlashDrafter, mine: DrafterSpec, path: str, log: Callable[[str], None]
) -> dict[str, torch.Tensor]:
    """Load the drafter at `path` (this tool's files, or a z-lab / speculators export) into
    `drafter`, whose spec is `mine`; a different geometry is refused. Returns the weights as
    read (the lineage hashes them)."""
    from dflash_trainer.formats.drafter_io import load_drafter

    try:
        spec, state, _ = load_drafter(path)
    except DFlashError:
        from dflash_trainer.formats.export import import_drafter

        spec, state, _ = import_drafter(path)
    diffs = init_differences(spec, mine)
    if diffs:
        raise DFlashError(
            f"drafter.init_from={path}: its geometry differs from this config's: {diffs}; "
            "make the drafter section match the imported drafter"
        )
    sel = drafter.candidate_selector
    if sel is not None and sel.codebooks == "embedding" and spec.is_dflash2:
        raise DFlashError(
            f"drafter.init_from={path}: its selector's codebooks are trained tables, which "
            "drafter.selector_codebooks=embedding cannot continue; continue it with "
            "selector_codebooks=tables (or start the selector from a DFlash drafter)"
        )
    missing, unexpected = drafter.load_state_dict(
        {k: v.float() for k, v in state.items()}, strict=False
    )
    # Only a DFlash backbone starting a DFlash2 run may lack tensors: the convolutions
    # and the selector, which then keep their no-op initialisation.
    new_modules = spec.kind == "dflash" and mine.is_dflash2
    lacking = [k for k in missing if not (new_modules and is_dflash2_tensor(k))]
    if lacking or unexpected:
        raise DFlashError(
            f"drafter.init_from={path}: weights do not match this drafter (missing "
            f"{lacking[:5]}, unexpected {unexpected[:5]})"
        )
    if new_modules:
        log(
            "DFlash2 modules (convolutions, selector) start as no-ops on the DFlash "
            "backbone: the drafter drafts exactly as it did until its first step"
        )
    return state
