"""The lm_head and every per-row quantity the loss reads from it, fused and chunked.

Shape legend: R = rows (anchor slots), H = hidden size, V = vocab, K = candidates per row.

The lm_head over all slots would be a [R, V] fp32 tensor (512*15*248320 floats is
7.6 GB), so `fused_head` never materialises it: it walks the rows in chunks, computes
each chunk's logits and from them, at once, everything the objective needs of that row:

- the row loss (ce to a label, or kl to the target's distribution) and its gradient
  w.r.t. the hidden row;
- the drafter's argmax and the label (the target's argmax when its distribution is given);
- optionally the acceptance probability alpha = sum_v min(p_v, q_v) = 1 - TV(p, q) of the
  drafter distribution q against the target's p (the lk loss), with its gradient;
- optionally the top-K candidate ids and logits (DFlash2's selector re-ranks them).

Only the [R, H] gradients are kept for the backward (which then costs a scale and an
add), so this is one lm_head matmul forward and one backward per chunk, against three
for recompute-in-backward, and its peak is one chunk of logits. The lm_head is the
frozen target's: no weight gradient is formed.

Logits are upcast to fp32 before softmax; kl and alpha use fp32 probabilities of both
sides, because in bf16 `p_draft - p_target` cancels badly.

d alpha / d z_j: alpha = sum_i min(p_i, q_i) and only the rows with q_i < p_i move with
q, so with m_i = [q_i < p_i], d alpha / d z_j = q_j m_j - q_j sum_i m_i q_i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16/fp16 logits -> fp32; fp64 stays fp64 for the tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def top_candidates(logits_RV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, ids) [R, k] of each row's k best tokens, best first, equal logits by
    ascending id: candidate 0 is then always torch.argmax's token, so an untrained selector
    drafts exactly DFlash's argmax even where a quantized lm_head has tied rows."""
    vals, ids = logits_RV.topk(k, dim=-1)
    ids, order = ids.sort(dim=-1)
    vals = vals.gather(-1, order)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(-1, order)


@dataclass(frozen=True)
class HeadSettings:
    base: str = "ce"
    """Row loss: ce (to labels, or to the target's argmax) or kl (to the target's p)."""
    loss_grad: bool = True
    """Whether the row loss is differentiated (False: computed for the metrics only)."""
    alpha: bool = False
    """Compute alpha = 1 - TV(p, q) per row (needs the target's distribution)."""
    top_k: int = 0
    """Candidates per row to return (0: none)."""
    chunk_rows: int = 2048


@dataclass(frozen=True)
class HeadRows:
    """Per-row outputs of `fused_head`."""

    loss: torch.Tensor
    """[R] fp32, differentiable w.r.t. the hidden rows (when loss_grad)."""
    pred: torch.Tensor
    """[R] the drafter's argmax."""
    label: torch.Tensor
    """[R] the label (given, or the target's argmax)."""
    alpha: torch.Tensor | None = None
    """[R] fp32 acceptance probability, differentiable."""
    cand_ids: torch.Tensor | None = None
    """[R, K] the drafter's top-K token ids, best first."""
    cand_logits: torch.Tensor | None = None
    """[R, K] fp32 their logits (no gradient)."""


def _chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    target_h: torch.Tensor | None,
    hs: HeadSettings,
    want_grad: bool,
) -> dict[str, Any]:
    """Every per-row output of one chunk, and the gradients w.r.t. h ('g_loss', 'g_alpha')."""
    logits = upcast(h @ weight.t())
    logp = torch.log_softmax(logits, dim=-1)
    q = logp.exp()
    out: dict[str, Any] = {"pred": logits.argmax(-1)}
    t_p = t_logp = None
    if target_h is not None:
        t_logp = torch.log_softmax(upcast(target_h @ weight.t()), dim=-1)
        t_p = t_logp.exp()
    label = labels if labels is not None else t_logp.argmax(-1)  # type: ignore[union-attr]
    out["label"] = label
    grad_logits = None
    if hs.base == "kl":
        assert t_p is not None and t_logp is not None
        out["loss"] = (t_p * (t_logp - logp)).sum(-1)
        if want_grad and hs.loss_grad:
            grad_logits = q - t_p
    else:
        out["loss"] = -logp.gather(1, label[:, None]).squeeze(1)
        if want_grad and hs.loss_grad:
            grad_logits = q.clone()
            grad_logits.scatter_add_(1, label[:, None], torch.full_like(q[:, :1], -1.0))
    out["g_loss"] = _to_hidden(grad_logits, weight, h)
    if hs.alpha:
        assert t_p is not None, "alpha needs the target's distribution"
        out["alpha"] = torch.minimum(q, t_p).sum(-1)
        g_alpha = None
        if want_grad:
            qm = q * (q < t_p)
            g_alpha = qm - q * qm.sum(-1, keepdim=True)
        out["g_alpha"] = _to_hidden(g_alpha, weight, h)
    if hs.top_k:
        vals, ids = top_candidates(logits, hs.top_k)
        out["cand_ids"], out["cand_logits"] = ids, vals
    return out


def _to_hidden(
    grad_logits: torch.Tensor | None, weight: torch.Tensor, h: torch.Tensor
) -> torch.Tensor | None:
    if grad_logits is None:
        return None
    return (grad_logits.to(weight.dtype) @ weight).to(h.dtype)


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor | None,
        target_h: torch.Tensor | None,
        hs: HeadSettings,
        want_grad: bool,
    ) -> tuple[torch.Tensor, ...]:
        r, dev = h.shape[0], h.device
        fdt = torch.promote_types(h.dtype, torch.float32)
        k = hs.top_k
        bufs: dict[str, torch.Tensor | None] = {
            "loss": h.new_empty(r, dtype=fdt),
            "pred": torch.empty(r, dtype=torch.long, device=dev),
            "label": torch.empty(r, dtype=torch.long, device=dev),
            "alpha": h.new_empty(r, dtype=fdt) if hs.alpha else None,
            "cand_ids": torch.empty(r, k, dtype=torch.long, device=dev) if k else None,
            "cand_logits": h.new_empty(r, k, dtype=fdt) if k else None,
            "g_loss": torch.empty_like(h) if want_grad and hs.loss_grad else None,
            "g_alpha": torch.empty_like(h) if want_grad and hs.alpha else None,
        }
        for s in range(0, r, hs.chunk_rows):
            e = min(r, s + hs.chunk_rows)
            lab = labels[s:e] if labels is not None else None
            th = target_h[s:e] if target_h is not None else None
            for name, val in _chunk(h[s:e], weight, lab, th, hs, want_grad).items():
                buf = bufs[name]
                if buf is not None and val is not None:
                    buf[s:e] = val
        g_loss, g_alpha = bufs["g_loss"], bufs["g_alpha"]
        ctx.save_for_backward(
            g_loss if g_loss is not None else h.new_empty(0),
            g_alpha if g_alpha is not None else h.new_empty(0),
        )
        # Outputs not asked for are distinct empty tensors (an output returned twice
        # confuses autograd); unused outputs' gradients arrive as None.
        ctx.set_materialize_grads(False)
        outs = [bufs[n] for n in ("loss", "alpha", "pred", "label", "cand_ids", "cand_logits")]
        res = tuple(o if o is not None else h.new_empty(0) for o in outs)
        ctx.mark_non_differentiable(*res[2:])
        return res

    @staticmethod
    def backward(ctx: Any, g_loss_R: Any, g_alpha_R: Any, *_: Any) -> tuple[Any, ...]:
        gl, ga = ctx.saved_tensors
        grad: torch.Tensor | None = None
        for saved, g in ((gl, g_loss_R), (ga, g_alpha_R)):
            if g is None or g.numel() == 0:
                continue
            if saved.numel() == 0:
                raise RuntimeError("fused_head output differentiated without its gradient")
            part = saved * g[:, None].to(saved.dtype)
            grad = part if grad is None else grad + part
        return (grad, None, None, None, None, None)


def fused_head(
    hidden_RH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_R: torch.Tensor | None = None,
    target_hidden_RH: torch.Tensor | None = None,
    settings: HeadSettings = HeadSettings(),
) -> HeadRows:
    """Per-row loss, argmax, label and the optional alpha / top-K of lm_head(hidden_RH).

    `target_hidden_RH` is the target's final normed hidden state at the predicting
    position: its lm_head row is the target's distribution (kl, alpha, and the label when
    `labels_R` is None). Differentiable w.r.t. hidden_RH only.
    """
    hs = settings
    needs_target = hs.base == "kl" or hs.alpha or labels_R is None
    if needs_target and target_hidden_RH is None:
        raise ValueError("this loss needs target_hidden_RH (the target's distribution)")
    if hs.base not in ("ce", "kl"):
        raise ValueError(f"unknown row loss {hs.base!r}; use ce or kl")
    if lm_head_weight_VH.requires_grad:
        raise ValueError("the target lm_head is frozen: pass lm_head.weight.detach()")
    want_grad = torch.is_grad_enabled() and hidden_RH.requires_grad
    # Compute in the lm_head's dtype: casting the [R, H] rows is cheap, casting a
    # bf16 [V, H] head to fp32 would copy gigabytes. Logits are upcast per chunk.
    w = lm_head_weight_VH
    th = target_hidden_RH.to(w.dtype) if target_hidden_RH is not None else None
    with torch.autocast(hidden_RH.device.type, enabled=False):
        loss, alpha, pred, label, ids, vals = _FusedHead.apply(
            hidden_RH.to(w.dtype), w, labels_R, th, hs, want_grad
        )
    return HeadRows(
        loss=loss,
        pred=pred,
        label=label,
        alpha=alpha if hs.alpha else None,
        cand_ids=ids if hs.top_k else None,
        cand_logits=vals if hs.top_k else None,
    )


def fused_linear_loss(
    hidden_RH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_R: torch.Tensor | None = None,
    target_hidden_RH: torch.Tensor | None = None,
    chunk_rows: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss [R], argmax [R], label [R]): CE against `labels_R`, or KL(target || draft)
    when `target_hidden_RH` is given (then the label is the target's argmax)."""
    if (labels_R is None) == (target_hidden_RH is None):
        raise ValueError("give exactly one of labels_R (ce) or target_hidden_RH (kl)")
    base = "ce" if labels_R is not None else "kl"
    rows = fused_head(
        hidden_RH,
        lm_head_weight_VH,
        labels_R,
        target_hidden_RH,
        HeadSettings(base=base, chunk_rows=chunk_rows),
    )
    return rows.loss, rows.pred, rows.label


def reference_head(
    hidden_RH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_R: torch.Tensor | None = None,
    target_hidden_RH: torch.Tensor | None = None,
    base: str = "ce",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unchunked autograd (loss [R], alpha [R] or None), for the tests."""
    logp = torch.log_softmax(upcast(hidden_RH @ lm_head_weight_VH.t()), -1)
    alpha = None
    t_logp = None
    if target_hidden_RH is not None:
        t_logp = torch.log_softmax(upcast(target_hidden_RH @ lm_head_weight_VH.t()), -1)
        alpha = torch.minimum(logp.exp(), t_logp.exp()).sum(-1)
    if base == "kl":
        assert t_logp is not None
        return (t_logp.exp() * (t_logp - logp)).sum(-1), alpha
    label = labels_R if labels_R is not None else t_logp.argmax(-1)  # type: ignore[union-attr]
    return -logp.gather(1, label[:, None]).squeeze(1), alpha


def reference_linear_loss(
    hidden_RH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_R: torch.Tensor | None = None,
    target_hidden_RH: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unchunked autograd version of `fused_linear_loss` (tests)."""
    base = "kl" if target_hidden_RH is not None else "ce"
    return reference_head(hidden_RH, lm_head_weight_VH, labels_R, target_hidden_RH, base)[0]
