"""DFlash2's selector term: a K-way cross-entropy over each slot's top-K candidates.

Shape legend: N = anchors, B = block size, K = candidates per slot, H = hidden size.

For every supervised slot k >= 1 of every block, all at once (no walk in training):

- the candidates are the backbone's current top-K tokens of that slot, with their logits
  as the unary scores (detached: the block loss trains the backbone's logits, and pushing
  the selector's gradient through K lm_head rows per slot would cost a second head pass);
- the predecessor is the true previous token: the anchor for slot 1, the label of slot
  k - 1 after it. At serving the predecessor is the walk's own previous choice, which is
  that same token whenever the block is still being accepted, so the teacher-forced
  prefix of right choices is exactly the walk's acceptance (`selector_tau`);
- the class is the label's index among the candidates.

A slot whose label is not among its K candidates has no class: it is left out of the
selector term (weight 0) and counted as a miss in `candidate_recall`. No selector can
accept there, so forcing the label into the list would teach it to prefer a token the
serving walk never sees; the block loss is what brings such a label into the top K.
Slots after an unsupervised slot are left out too (their predecessor is not a token the
walk could have reached).

The gradient reaches the three selector tensors and, through the gate P h, the drafter's
hidden states. Weights are the block loss's slot weights (decay or dpace), normalised
over the slots that count.
"""

from __future__ import annotations

import torch

from dflash_trainer.core.dflash2 import CandidateSelector


def prefix_tau(ok_NB: torch.Tensor, real_N: torch.Tensor) -> torch.Tensor:
    """Mean over real blocks of 1 + the run of leading true slots k = 1, 2, ..."""
    run = torch.cumprod(ok_NB[:, 1:].long(), dim=-1).sum(-1)
    real = real_N.float()
    return ((1 + run.float()) * real).sum() / real.sum().clamp(min=1)


def selector_terms(
    selector: CandidateSelector,
    hidden_NBH: torch.Tensor,
    anchor_ids_N: torch.Tensor,
    label_NB: torch.Tensor,
    cand_ids_NBK: torch.Tensor,
    cand_logits_NBK: torch.Tensor,
    valid_NB: torch.Tensor,
    real_N: torch.Tensor,
    weight_NB: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(selector loss, metrics): candidate_recall, selector_accuracy, selector_tau
    (the walk's in-batch acceptance), oracle_tau (acceptance if every slot picked right
    whenever the label is a candidate), selector_loss. Fixed shapes, no host reads."""
    n, b, h = hidden_NBH.shape
    k = cand_ids_NBK.shape[-1]
    # Slot 0 is the anchor itself (no loss); slot 1 follows the anchor; slot k >= 2 the label
    # of slot k - 1 (the label of slot 0 is not a token of the block: never a predecessor).
    anchor = anchor_ids_N.view(n, 1)
    prev_NB = torch.cat([anchor, anchor, label_NB[:, 1:-1]], dim=1)
    # Slot 1's predecessor is the anchor (always known); slot k >= 2's is slot k - 1's label.
    prev_ok = torch.ones_like(valid_NB)
    prev_ok[:, 2:] = valid_NB[:, 1:-1]
    slot = valid_NB.clone()
    slot[:, 0] = False
    hit_NBK = cand_ids_NBK == label_NB[..., None]
    covered = hit_NBK.any(-1) & slot
    counts = covered & prev_ok
    scores = selector(
        hidden_NBH.reshape(n * b, h),
        prev_NB.reshape(-1),
        cand_ids_NBK.reshape(n * b, k),
        cand_logits_NBK.reshape(n * b, k).detach(),
    ).view(n, b, k)
    target = hit_NBK.float().argmax(-1)
    ce = torch.logsumexp(scores, -1) - scores.gather(-1, target[..., None]).squeeze(-1)
    w = weight_NB * counts
    den = w.sum()
    ce = torch.where(counts, ce, torch.zeros_like(ce))
    loss = (w * ce).sum() / den.clamp(min=torch.finfo(den.dtype).tiny)
    pick = scores.argmax(-1, keepdim=True)
    right = (cand_ids_NBK.gather(-1, pick).squeeze(-1) == label_NB) & covered
    n_slots = slot.sum().clamp(min=1).float()
    metrics = {
        "selector_loss": loss,
        "candidate_recall": covered.sum().float() / n_slots,
        "selector_accuracy": right.sum().float() / n_slots,
        "selector_tau": prefix_tau(right, real_N),
        "oracle_tau": prefix_tau(covered, real_N),
    }
    return loss, metrics
