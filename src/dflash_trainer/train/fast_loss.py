"""The DFlash objective with fixed shapes and no host reads (the fast step's loss).

Shape legend: N = anchors (padded to a fixed count), B = block size, H = hidden size.

`core.loss.dflash_loss` gathers the valid slots (`nonzero`, a data-dependent shape) and
tests the weight sum on the host, both of which wait for the GPU. Here every one of the
N*B slots goes through the fused lm_head and invalid slots are masked out by their zero
weight: the lm_head sees padding rows too (at most a few percent more rows with a dense
pack), and nothing waits. On valid slots the per-row outputs are those of `dflash_loss`
(the same fused chunks over the same rows) and both combine them with
`core.loss.combine_terms`, so the loss and metrics equal it up to float summation order.
"""

from __future__ import annotations

import torch

from dflash_trainer.core.fused_head import fused_head
from dflash_trainer.core.loss import (
    DFlash2Inputs,
    LossResult,
    Objective,
    combine_terms,
    grid_from_rows,
)


def fixed_shape_loss(
    hidden_NBH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    valid_NB: torch.Tensor,
    real_N: torch.Tensor,
    labels_NB: torch.Tensor | None = None,
    target_hidden_NBH: torch.Tensor | None = None,
    weighting: str = "decay",
    gamma: float = 7.0,
    dpace_alpha: float = 0.5,
    chunk_rows: int = 2048,
    objective: Objective | None = None,
    dflash2: DFlash2Inputs | None = None,
) -> LossResult:
    """The objective of `dflash_loss`, over all N*B rows."""
    if objective is None:
        loss = "ce" if labels_NB is not None else "kl"
        objective = Objective(loss, weighting, gamma, dpace_alpha, chunk_rows)
    n, b, h = hidden_NBH.shape
    flat = hidden_NBH.reshape(n * b, h)
    labels = labels_NB.reshape(-1) if labels_NB is not None else None
    t_h = target_hidden_NBH.reshape(n * b, -1) if target_hidden_NBH is not None else None
    head = fused_head(flat, lm_head_weight_VH, labels, t_h, objective.head())
    grid = grid_from_rows(head, None, n, b)
    return combine_terms(grid, valid_NB, real_N, objective, dflash2, hidden_NBH)
