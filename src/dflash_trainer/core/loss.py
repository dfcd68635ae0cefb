"""The DFlash objective: slot weights, the block loss and its extra terms, and the
acceptance metrics (docs/algorithm.md section 4).

Shape legend: N = anchors, B = block size, R = rows (valid slots, gathered),
H = hidden size, V = vocab, K = candidates per slot.

The lm_head and everything read from its logits per row (loss, argmax, acceptance
probability, top-K candidates) is `core.fused_head` (chunked, never [R, V] at once).
Here the per-row outputs are laid back on the [N, B] grid of blocks and combined:

    loss = block loss (ce or kl, decay or dpace weights)          training.loss ce | kl
         + lk_weight * lk                                          the acceptance-direct term
         + selector_loss_weight * selector CE                      DFlash2 only

with lk = - mean over blocks of E[accepted] = sum_k prod_{j <= k} alpha_j, alpha_j =
1 - TV(draft_j, target_j) (training.loss lk: that term alone). The standard step gathers
the valid rows before the head; the fast step (train/fast_loss.py) sends every row and
lets zero weights mask the rest; both combine through `combine_terms`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trainer.core.dflash2 import CandidateSelector
from dflash_trainer.core.fused_head import HeadRows, HeadSettings, fused_head
from dflash_trainer.core.selector_loss import selector_terms

# ------------------------------------------------------------------------ weights


def decay_weights(
    block_size: int, gamma: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[B] w_k = exp(-(k-1)/gamma) for k >= 1, w_0 = 0 (the anchor is given, not predicted)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    # A mask, not `w[0] = 0`: item assignment copies a host scalar to the GPU and waits for
    # it, which the fast step must not do (tests/test_fast_step_gpu.py).
    return torch.exp(-(k - 1).clamp(min=0) / gamma) * (k >= 1)


def decay_slot_weights(
    valid_NB: torch.Tensor, gamma: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[N, B] decay weight of each valid slot, 0 elsewhere: the weights `dflash_loss` uses.

    The trainer sums these before the drafter runs to normalise a step over ranks and
    micro-steps, so both must come from this one function.
    """
    b = valid_NB.shape[1]
    return decay_weights(b, gamma, valid_NB.device).to(dtype)[None, :] * valid_NB


def dpace_weights(ce_NB: torch.Tensor, valid_NB: torch.Tensor, alpha: float) -> torch.Tensor:
    """[N, B] D-PACE: w_k = sum_{j >= k} prod_{i <= j} s_i over valid slots, no grad.

    s_i = (1 - alpha) * exp(-ce_i) + alpha is the smoothed confidence of slot i; a slot
    counts for every later acceptance it enables, weighted by how likely the block
    gets that far.
    """
    with torch.no_grad():
        conf = torch.exp(-ce_NB.float())
        smooth = torch.where(valid_NB, (1 - alpha) * conf + alpha, torch.ones_like(conf))
        prefix = torch.cumprod(smooth, dim=-1) * valid_NB
        suffix = prefix.flip(-1).cumsum(-1).flip(-1)
        return suffix * valid_NB


# ------------------------------------------------------------------------ metrics


def acceptance_metrics(
    correct_NB: torch.Tensor, valid_NB: torch.Tensor, real_N: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-slot accuracy, exact in-batch acceptance and the implied expected tau.

    Exact: per block, 1 + the length of the run of slots k = 1, 2, ... that are valid
    and correct. Expected: 1 + sum_k prod_{j <= k} acc_j (assumes independence).
    """
    ok = (correct_NB & valid_NB)[:, 1:]
    run = torch.cumprod(ok.long(), dim=-1).sum(-1)
    n_real = real_N.sum().clamp(min=1)
    exact_tau = (1 + run.float())[real_N].sum() / n_real
    valid_k = valid_NB[:, 1:].sum(0)
    acc_k = ok.sum(0).float() / valid_k.clamp(min=1).float()
    expected_tau = 1 + torch.cumprod(acc_k, 0).sum()
    return {
        "slot_acc": acc_k,
        "slot_count": valid_k,
        "exact_tau": exact_tau,
        "expected_tau": expected_tau,
        "accuracy": ok.sum().float() / valid_k.sum().clamp(min=1).float(),
        # Averages over steps must weigh by these (a step can have no anchors at all).
        "anchors": real_N.sum().float(),
    }


@dataclass(frozen=True)
class LossResult:
    loss: torch.Tensor
    """Scalar: the weighted sum of the objective's terms (0, with a graph, when no slot)."""
    metrics: dict[str, torch.Tensor]
    """Detached: mean_loss, slot_acc [B-1], slot_count, exact_tau, expected_tau, accuracy,
    and per term its loss and acceptance (base_loss, lk_loss, lk_tau, selector_loss,
    candidate_recall, selector_accuracy, selector_tau, oracle_tau)."""


@dataclass(frozen=True)
class Objective:
    """What the step optimises (from training.* and the drafter kind)."""

    loss: str = "ce"
    """ce | kl | lk."""
    weighting: str = "decay"
    gamma: float = 7.0
    dpace_alpha: float = 0.5
    chunk_rows: int = 2048
    lk_weight: float = 0.0
    selector_weight: float = 1.0
    top_k: int = 0
    """Candidates per slot for DFlash2's selector (0: DFlash)."""

    def head(self) -> HeadSettings:
        lk = self.loss == "lk" or self.lk_weight > 0
        return HeadSettings(
            base="kl" if self.loss == "kl" else "ce",
            loss_grad=self.loss != "lk",
            alpha=lk,
            top_k=self.top_k,
            chunk_rows=self.chunk_rows,
        )


@dataclass(frozen=True)
class GridRows:
    """`HeadRows` laid on the [N, B] grid (rows of invalid slots hold anything finite)."""

    loss_NB: torch.Tensor
    pred_NB: torch.Tensor
    label_NB: torch.Tensor
    alpha_NB: torch.Tensor | None
    cand_ids_NBK: torch.Tensor | None
    cand_logits_NBK: torch.Tensor | None


@dataclass(frozen=True)
class DFlash2Inputs:
    """What the selector term reads beside the head's rows."""

    selector: CandidateSelector
    anchor_ids_N: torch.Tensor
    hidden_NBH: torch.Tensor


def slot_weights(grid: GridRows, valid_NB: torch.Tensor, obj: Objective) -> torch.Tensor:
    if obj.weighting == "dpace":
        return dpace_weights(grid.loss_NB.detach(), valid_NB, obj.dpace_alpha)
    if obj.weighting == "decay":
        return decay_slot_weights(valid_NB, obj.gamma, grid.loss_NB.dtype)
    raise ValueError(f"unknown weighting {obj.weighting!r}; use decay or dpace")


def lk_term(
    alpha_NB: torch.Tensor, valid_NB: torch.Tensor, real_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(-mean E[accepted drafts], mean E[tau]) over real blocks.

    E[accepted] = sum_k prod_{j <= k} alpha_j over slots 1..B-1; an invalid slot has
    alpha 0, so a block's expectation stops where its supervision does.
    """
    a = torch.where(valid_NB, alpha_NB, torch.zeros_like(alpha_NB))[:, 1:]
    expected = torch.cumprod(a, dim=-1).sum(-1)
    real = real_N.to(expected.dtype)
    mean = (expected * real).sum() / real.sum().clamp(min=1)
    return -mean, 1 + mean.detach()


def combine_terms(
    grid: GridRows,
    valid_NB: torch.Tensor,
    real_N: torch.Tensor,
    obj: Objective,
    dflash2: DFlash2Inputs | None,
    hidden_for_graph: torch.Tensor,
) -> LossResult:
    """The objective's terms and metrics from the per-slot rows (no host reads)."""
    w = slot_weights(grid, valid_NB, obj)
    denom = w.sum()
    loss_NB = torch.where(valid_NB, grid.loss_NB, torch.zeros_like(grid.loss_NB))
    # No weight at all: the numerator is an exact 0 (and keeps the graph), so 0 / tiny = 0.
    base = (w * loss_NB).sum() / denom.clamp(min=torch.finfo(denom.dtype).tiny)
    metrics = acceptance_metrics_fixed(grid.pred_NB == grid.label_NB, valid_NB, real_N)
    total = hidden_for_graph.sum() * 0.0
    if obj.loss != "lk":
        total = total + base
    if grid.alpha_NB is not None:
        lk, lk_tau = lk_term(grid.alpha_NB, valid_NB, real_N)
        total = total + (lk if obj.loss == "lk" else obj.lk_weight * lk)
        metrics["lk_loss"], metrics["lk_tau"] = lk, lk_tau
    if dflash2 is not None:
        assert grid.cand_ids_NBK is not None and grid.cand_logits_NBK is not None
        sel_loss, sel_metrics = selector_terms(
            dflash2.selector,
            dflash2.hidden_NBH,
            dflash2.anchor_ids_N,
            grid.label_NB,
            grid.cand_ids_NBK,
            grid.cand_logits_NBK,
            valid_NB,
            real_N,
            w.detach(),
        )
        total = total + obj.selector_weight * sel_loss
        metrics.update(sel_metrics)
    per_slot = valid_NB.sum(0)[1:].clamp(min=1)
    metrics["base_loss"] = base
    metrics["slot_loss"] = (loss_NB * valid_NB).sum(0)[1:] / per_slot
    metrics["mean_loss"] = loss_NB.sum() / valid_NB.sum().clamp(min=1)
    metrics["valid_slots"] = valid_NB.sum()
    metrics["weight_sum"] = denom
    return LossResult(loss=total, metrics={k: v.detach() for k, v in metrics.items()})


def acceptance_metrics_fixed(
    correct_NB: torch.Tensor, valid_NB: torch.Tensor, real_N: torch.Tensor
) -> dict[str, torch.Tensor]:
    """`acceptance_metrics` without boolean indexing (same values, no host reads)."""
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


def grid_from_rows(rows: HeadRows, where_R: torch.Tensor | None, n: int, b: int) -> GridRows:
    """Lay per-row outputs on [N, B]: row r goes to flat slot where_R[r] (None: all, in order)."""

    def lay(x: torch.Tensor | None, fill: float | int = 0) -> torch.Tensor | None:
        if x is None:
            return None
        if where_R is None:
            return x.view(n, b, *x.shape[1:])
        out = x.new_full((n * b, *x.shape[1:]), fill)
        out = out.index_put((where_R,), x)
        return out.view(n, b, *x.shape[1:])

    loss, pred, label = lay(rows.loss), lay(rows.pred), lay(rows.label)
    assert loss is not None and pred is not None and label is not None
    return GridRows(
        loss,
        pred,
        label,
        lay(rows.alpha),
        lay(rows.cand_ids),
        lay(rows.cand_logits),
    )


def dflash_loss(
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
    """The objective over all blocks of a step; only valid slots go through the lm_head.

    `labels_NB` (ce: target argmax or dataset token) and/or `target_hidden_NBH` (the
    target's final hidden state at a+k-1: kl, lk, and the label when labels_NB is None).
    `objective` None: ce with labels, or kl with the target's hidden states, weighted as
    the keyword arguments say.
    """
    if objective is None:
        loss = "ce" if labels_NB is not None else "kl"
        objective = Objective(loss, weighting, gamma, dpace_alpha, chunk_rows)
    n, b, h = hidden_NBH.shape
    rows = valid_NB.reshape(-1).nonzero().squeeze(1)
    flat_h = hidden_NBH.reshape(n * b, h)[rows]
    labels = labels_NB.reshape(-1)[rows] if labels_NB is not None else None
    t_h = target_hidden_NBH.reshape(n * b, -1)[rows] if target_hidden_NBH is not None else None
    if rows.numel() == 0:
        # Nothing supervised: an exact 0 that keeps the graph, and zero metrics.
        zero_grid = GridRows(
            hidden_NBH.new_zeros(n, b, dtype=torch.float32),
            valid_NB.long(),
            valid_NB.long() + 1,
            None,
            None,
            None,
        )
        return combine_terms(
            zero_grid, valid_NB, real_N, Objective(weighting=objective.weighting), None, hidden_NBH
        )
    head = fused_head(flat_h, lm_head_weight_VH, labels, t_h, objective.head())
    grid = grid_from_rows(head, rows, n, b)
    return combine_terms(grid, valid_NB, real_N, objective, dflash2, hidden_NBH)
