"""The DFlash objective with fixed shapes and no host reads (the fast step's loss).

Shape legend: N = anchors (padded to a fixed count), B = block size, H = hidden size.

`core.loss.dflash_loss` gathers the valid slots (`nonzero`, a data-dependent shape) and
tests the weight sum on the host, both of which wait for the GPU. Here every one of the
N*B slots goes through the fused lm_head loss and invalid slots are masked out by their
zero weight: the lm_head sees padding rows too (at most a few percent more rows with a
dense pack), and nothing waits. On valid slots the per-row losses, predictions and
labels are those of `dflash_loss` (the same fused chunks over the same rows), so the
loss and metrics equal it up to float summation order.
"""

from __future__ import annotations

import torch

from dflash_trainer.core.loss import (
    LossResult,
    decay_slot_weights,
    dpace_weights,
    fused_linear_loss,
)


def fixed_acceptance_metrics(
    correct_NB: torch.Tensor, valid_NB: torch.Tensor, real_N: torch.Tensor
) -> dict[str, torch.Tensor]:
    """`core.loss.acceptance_metrics` without boolean indexing (same values)."""
    ok = (correct_NB & valid_NB)[:, 1:]
    run = torch.cumprod(ok.long(), dim=-1).sum(-1)
    real = real_N.float()
    n_real = real.sum().clamp(min=1)
    valid_k = valid_NB[:, 1:].sum(0)
    acc_k = ok.sum(0).float() / valid_k.clamp(min=1).float()
    return {
        "slot_acc": acc_k,
        "slot_count": valid_k,
        "exact_tau": ((1 + run.float()) * real).sum() / n_real,
        "expected_tau": 1 + torch.cumprod(acc_k, 0).sum(),
        "accuracy": ok.sum().float() / valid_k.sum().clamp(min=1).float(),
        "anchors": real.sum(),
    }


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
) -> LossResult:
    """sum(w * l) / sum(w) over valid slots, as `dflash_loss`, over all N*B rows."""
    n, b, h = hidden_NBH.shape
    flat = hidden_NBH.reshape(n * b, h)
    labels = labels_NB.reshape(-1) if labels_NB is not None else None
    t_h = target_hidden_NBH.reshape(n * b, -1) if target_hidden_NBH is not None else None
    row_loss, pred, label = fused_linear_loss(flat, lm_head_weight_VH, labels, t_h, chunk_rows)
    valid = valid_NB.reshape(-1)
    # where (not a product): a padding row's loss never reaches the sum, even if non-finite.
    loss_NB = torch.where(valid, row_loss, torch.zeros_like(row_loss)).view(n, b)
    correct_NB = ((pred == label) & valid).view(n, b)
    if weighting == "dpace":
        w = dpace_weights(loss_NB.detach(), valid_NB, dpace_alpha)
    elif weighting == "decay":
        w = decay_slot_weights(valid_NB, gamma, loss_NB.dtype)
    else:
        raise ValueError(f"unknown weighting {weighting!r}; use decay or dpace")
    denom = w.sum()
    # No weight at all: the numerator is an exact 0 (and keeps the graph), so 0 / tiny = 0.
    loss = (w * loss_NB).sum() / denom.clamp(min=torch.finfo(denom.dtype).tiny)

    metrics = fixed_acceptance_metrics(correct_NB, valid_NB, real_N)
    per_slot = valid_NB.sum(0)[1:].clamp(min=1)
    metrics["slot_loss"] = (loss_NB * valid_NB).sum(0)[1:].detach() / per_slot
    metrics["mean_loss"] = loss_NB.detach().sum() / valid.sum().clamp(min=1)
    metrics["valid_slots"] = valid_NB.sum()
    metrics["weight_sum"] = denom
    return LossResult(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})
