"""Slot losses, weights and acceptance metrics (docs/algorithm.md section 4).

Shape legend: N = anchors, B = block size, R = rows (valid slots, gathered),
H = hidden size, V = vocab.

The lm_head over all slots would be a [R, V] fp32 tensor (512*15*248320 floats is
7.6 GB), so `fused_linear_loss` never materialises it: it walks the rows in chunks,
computes each chunk's logits, per-row loss, argmax and the gradient w.r.t. the
hidden rows at once, and keeps only the [R, H] gradient for the backward (which then
costs nothing but a scale). This is one lm_head matmul forward and one backward per
chunk, against three for recompute-in-backward, and its peak is one chunk of logits.
The lm_head is the frozen target's: no weight gradient is formed.

Logits are upcast to fp32 before softmax; KL uses fp32 probabilities of both sides,
because in bf16 `p_draft - p_target` cancels badly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# -------------------------------------------------------------- fused lm_head + loss


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16/fp16 logits -> fp32; fp64 stays fp64 for the tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunk_loss_and_grad(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    target_h: torch.Tensor | None,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss [r] fp32, pred [r], label [r], grad_h [r, H] or None) for one chunk."""
    logits = _upcast(h @ weight.t())
    logp = torch.log_softmax(logits, dim=-1)
    pred = logits.argmax(-1)
    if target_h is not None:
        t_logp = torch.log_softmax(_upcast(target_h @ weight.t()), dim=-1)
        t_p = t_logp.exp()
        loss = (t_p * (t_logp - logp)).sum(-1)
        label = t_logp.argmax(-1)
        grad_logits = logp.exp() - t_p if want_grad else None
    else:
        assert labels is not None
        label = labels
        loss = -logp.gather(1, labels[:, None]).squeeze(1)
        if want_grad:
            grad_logits = logp.exp()
            grad_logits.scatter_add_(1, labels[:, None], torch.full_like(loss[:, None], -1.0))
        else:
            grad_logits = None
    grad_h = (
        (grad_logits.to(weight.dtype) @ weight).to(h.dtype) if grad_logits is not None else None
    )
    return loss, pred, label, grad_h


class _FusedLinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor | None,
        target_h: torch.Tensor | None,
        chunk_rows: int,
        want_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = h.shape[0]
        loss = h.new_empty(r, dtype=torch.promote_types(h.dtype, torch.float32))
        pred = torch.empty(r, dtype=torch.long, device=h.device)
        label = torch.empty(r, dtype=torch.long, device=h.device)
        grad_h = torch.empty_like(h) if want_grad else None
        for s in range(0, r, chunk_rows):
            e = min(r, s + chunk_rows)
            lab = labels[s:e] if labels is not None else None
            th = target_h[s:e] if target_h is not None else None
            cl, cp, cy, cg = _chunk_loss_and_grad(h[s:e], weight, lab, th, want_grad)
            loss[s:e] = cl
            pred[s:e] = cp
            label[s:e] = cy
            if grad_h is not None and cg is not None:
                grad_h[s:e] = cg
        ctx.save_for_backward(grad_h if grad_h is not None else h.new_empty(0))
        ctx.mark_non_differentiable(pred, label)
        return loss, pred, label

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _gp: Any, _gl: Any) -> tuple[Any, ...]:
        (grad_h,) = ctx.saved_tensors
        if grad_h.numel() == 0:
            raise RuntimeError("fused_linear_loss was run without want_grad but is differentiated")
        return (grad_h * grad_loss[:, None].to(grad_h.dtype), None, None, None, None, None)


def fused_linear_loss(
    hidden_RH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_R: torch.Tensor | None = None,
    target_hidden_RH: torch.Tensor | None = None,
    chunk_rows: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss [R] (fp32), drafter argmax [R] and label [R] of lm_head(hidden_RH).

    CE against `labels_R`, or KL(target || draft) when `target_hidden_RH` (the target's
    final normed hidden state at the predicting position) is given; then the label is
    the target's argmax. Differentiable w.r.t. hidden_RH only.
    """
    if (labels_R is None) == (target_hidden_RH is None):
        raise ValueError("give exactly one of labels_R (ce) or target_hidden_RH (kl)")
    if lm_head_weight_VH.requires_grad:
        raise ValueError("the target lm_head is frozen: pass lm_head.weight.detach()")
    want_grad = torch.is_grad_enabled() and hidden_RH.requires_grad
    # Compute in the lm_head's dtype: casting the [R, H] rows is cheap, casting a
    # bf16 [V, H] head to fp32 would copy gigabytes. Logits are upcast per chunk.
    w = lm_head_weight_VH
    th = target_hidden_RH.to(w.dtype) if target_hidden_RH is not None else None
    with torch.autocast(hidden_RH.device.type, enabled=False):
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _FusedLinearLoss.apply(
            hidden_RH.to(w.dtype), w, labels_R, th, chunk_rows, want_grad
        )
    return out


def reference_linear_loss(
    hidden_RH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_R: torch.Tensor | None = None,
    target_hidden_RH: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unchunked autograd version (tests)."""
    logp = torch.log_softmax(_upcast(hidden_RH @ lm_head_weight_VH.t()), -1)
    if target_hidden_RH is not None:
        t_logp = torch.log_softmax(_upcast(target_hidden_RH @ lm_head_weight_VH.t()), -1)
        return (t_logp.exp() * (t_logp - logp)).sum(-1)
    assert labels_R is not None
    return -logp.gather(1, labels_R[:, None]).squeeze(1)


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
    """Scalar: sum(w * l) / sum(w) over valid slots (0, with a graph, when none)."""
    metrics: dict[str, torch.Tensor]
    """Detached: ce/kl mean, slot_acc [B-1], slot_count, exact_tau, expected_tau, accuracy."""


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
) -> LossResult:
    """The DFlash objective over all blocks of a step.

    Only valid slots go through the lm_head. `labels_NB` (ce: target argmax or dataset
    token) or `target_hidden_NBH` (kl: target's final hidden state at a+k-1).
    """
    n, b, h = hidden_NBH.shape
    rows = valid_NB.reshape(-1).nonzero().squeeze(1)
    flat_h = hidden_NBH.reshape(n * b, h)[rows]
    labels = labels_NB.reshape(-1)[rows] if labels_NB is not None else None
    t_h = target_hidden_NBH.reshape(n * b, -1)[rows] if target_hidden_NBH is not None else None
    if rows.numel() > 0:
        row_loss, pred, label = fused_linear_loss(
            flat_h, lm_head_weight_VH, labels, t_h, chunk_rows
        )
    else:
        row_loss = flat_h.new_zeros(0, dtype=torch.promote_types(flat_h.dtype, torch.float32))
        pred = label = rows

    dev = hidden_NBH.device
    loss_NB = row_loss.new_zeros(n * b).index_put((rows,), row_loss)
    loss_NB = loss_NB.view(n, b)
    correct = torch.zeros(n * b, dtype=torch.bool, device=dev)
    correct[rows] = pred == label
    correct_NB = correct.view(n, b)

    if weighting == "dpace":
        w = dpace_weights(loss_NB.detach(), valid_NB, dpace_alpha)
    elif weighting == "decay":
        w = decay_slot_weights(valid_NB, gamma, loss_NB.dtype)
    else:
        raise ValueError(f"unknown weighting {weighting!r}; use decay or dpace")
    denom = w.sum()
    # An all-masked step: 0 * sum keeps the graph connected, no 0/0.
    loss = (w * loss_NB).sum() / denom if float(denom) > 0 else hidden_NBH.sum() * 0.0

    metrics = acceptance_metrics(correct_NB, valid_NB, real_N)
    metrics["slot_loss"] = (loss_NB * valid_NB).sum(0)[1:].detach() / valid_NB.sum(0)[1:].clamp(
        min=1
    )
    metrics["mean_loss"] = row_loss.detach().mean() if rows.numel() else torch.zeros((), device=dev)
    metrics["valid_slots"] = valid_NB.sum()
    metrics["weight_sum"] = denom
    return LossResult(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})
