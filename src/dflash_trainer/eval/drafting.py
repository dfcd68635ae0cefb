"""From a drafted block's hidden states to drafted tokens, and the rejection-sampling verify.

Shape legend: S = drafted slots (B - 1), H = hidden size, V = vocab, K = candidates.

How a block's tokens are chosen (`draft_tokens`, the same ops eagerly and inside a CUDA
graph, no host reads):

- DFlash, greedy: the argmax of each slot's logits.
- DFlash, sampled (t > 0 with draft sampling on): each slot drawn from q = softmax(z / t)
  over the vocabulary, independently (DFlash drafts every slot in one parallel pass), by an
  inverse CDF in two levels of masked sums (`_inverse_cdf`: no scan over the vocabulary,
  which torch.compile could not build on a GPU).
- DFlash2: the top-K candidates of each slot, scored by the selector's lattice and walked
  from the anchor: argmax per slot given the previous choice (greedy), or a draw from
  q_s = softmax(S_s(previous choice, .) / t) over the K candidates (sampled).

Draws use uniforms drawn beforehand from the loop's generator (inverse CDF), so a CUDA graph
can replay them.

Verifying a sampled block (`rejection_verify`): the target's distribution p_s at each slot
(temperature and top-p applied) against the q_s the draft was drawn from: slot s is kept
with probability min(1, p_s(x_s) / q_s(x_s)); at the first rejection the token is drawn from
normalize(max(p_s - q_s, 0)) (p_s itself if that is empty), and after a fully kept block the
bonus from the last row. This is standard speculative sampling: for any proposal whose q_s
depends only on the context and the drafted prefix (true of both kinds: the slot's hidden
state depends on the context only, the selector's q_s on the previous token only), every
committed token is distributed exactly as target-only sampling. A greedy draft is the case
q_s = one-hot, which the loop verifies by its cheaper equivalent: sample the target's token
and keep the draft when they agree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dflash_trainer.core.dflash2 import CandidateSelector, walk_greedy, walk_sample
from dflash_trainer.core.fused_head import top_candidates


class Proposal(NamedTuple):
    """A sampled block: its tokens and the distributions they were drawn from."""

    tokens_S: torch.Tensor
    q_SK: torch.Tensor
    """Probabilities [S, K] over `ids_SK`, or [S, V] over the vocabulary when ids_SK is None."""
    ids_SK: torch.Tensor | None


def _running_sums(x_SN: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sums along the last dim, each a masked sum over the whole row
    (no scan). One summation order for every prefix, and float addition is monotone, so the
    sums never decrease along the row."""
    n = x_SN.shape[-1]
    i = torch.arange(n, device=x_SN.device)
    upto_NN = i[None, :] <= i[:, None]  # [prefix end, term]
    return torch.where(upto_NN, x_SN.unsqueeze(-2), 0.0).sum(-1)


def _inverse_cdf(q_SV: torch.Tensor, uniforms_S: torch.Tensor) -> torch.Tensor:
    """One index per row drawn from the row's distribution (a vocabulary's worth of
    entries) by inverse CDF, without a cumulative sum over the row.

    Why: torch.compile turns a cumsum over tens of thousands of entries per row into
    inductor's split scan (several blocks per row on a GPU), whose code generation fails
    with "list indices must be integers or slices, not NoneType" when the scan's input
    reads a per-row value, as softmax's maximum and sum are (pytorch/pytorch#180221, fixed
    after torch 2.11; seen on an H100 with SmolLM2's 49152 tokens: the DFlash step at t > 0
    fell back to uncompiled). This draws with the same uniform in two levels of about
    sqrt(V) entries each, from masked sums (no scan): the chunk of W consecutive tokens
    whose running total first reaches u times the row's total, then, in that chunk, the
    token whose running total first reaches the rest (rescaled to the chunk's own sum).
    With exact sums that is the index the flat inverse CDF picks, so a draw is exactly
    from q up to float rounding, as the flat one is; and it never picks a token of
    probability 0 (for u > 0).
    """
    s, v = q_SV.shape
    w = 1 << ((v - 1).bit_length() + 1) // 2  # the power of two at or above sqrt(V)
    c = -(-v // w)
    q_SCW = torch.nn.functional.pad(q_SV, (0, c * w - v)).view(s, c, w)  # padding: q = 0
    upto_SC = _running_sums(q_SCW.sum(-1))
    # u times the total: a total a hair under 1 never lets u miss every chunk.
    target_S = uniforms_S.to(q_SV.dtype) * upto_SC[:, -1]
    # The first chunk whose running total reaches the target (searchsorted, side left).
    chunk_S = (upto_SC < target_S[:, None]).sum(-1).clamp(max=c - 1)
    before_S1 = torch.nn.functional.pad(upto_SC[:, :-1], (1, 0)).gather(1, chunk_S[:, None])
    mass_S1 = upto_SC.gather(1, chunk_S[:, None]) - before_S1
    # Where the target falls inside the chosen chunk, in [0, 1]; 0 for an empty chunk,
    # which only u = 0 picks (the chunk of index 0, like the flat search).
    frac_S = torch.where(mass_S1 > 0, (target_S[:, None] - before_S1) / mass_S1, 0.0).squeeze(1)
    row_SW = q_SCW.gather(1, chunk_S.view(s, 1, 1).expand(s, 1, w)).squeeze(1)
    upto_SW = _running_sums(row_SW)
    inside_S = (upto_SW < (frac_S * upto_SW[:, -1])[:, None]).sum(-1).clamp(max=w - 1)
    return (chunk_S * w + inside_S).clamp(max=v - 1)


def draft_tokens(
    hidden_SH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    anchor_id: torch.Tensor,
    selector: CandidateSelector | None,
    top_k: int,
    temperature: float,
    uniforms_S: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(tokens [S], q or None, candidate ids [S, K] or None); q is None for a greedy draft.

    `uniforms_S` None: greedy (argmax, or the selector's greedy walk); else a sampled draft
    at `temperature` > 0.
    """
    logits = (hidden_SH.to(lm_head_VH.dtype) @ lm_head_VH.t()).float()
    if selector is None:
        if uniforms_S is None:
            return logits.argmax(-1), None, None
        q = torch.softmax(logits / temperature, dim=-1)
        return _inverse_cdf(q, uniforms_S), q, None
    vals, cand = top_candidates(logits, top_k)
    lattice = selector.lattice(hidden_SH, anchor_id.view(()), cand, vals)
    if uniforms_S is None:
        pick = walk_greedy(lattice)
        return cand.gather(1, pick[:, None]).squeeze(1), None, cand
    pick, q = walk_sample(lattice, temperature, uniforms_S)
    return cand.gather(1, pick[:, None]).squeeze(1), q, cand


def dense_q(p: Proposal, vocab: int) -> torch.Tensor:
    """q of each slot over the vocabulary [S, V] (zero outside the candidates)."""
    if p.ids_SK is None:
        return p.q_SK.float()
    out = torch.zeros(p.q_SK.shape[0], vocab, device=p.q_SK.device)
    return out.scatter(1, p.ids_SK, p.q_SK.float())


def rejection_verify(
    proposal: Proposal,
    p_rows: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """(committed tokens, drafts accepted) of one block.

    `p_rows` [S + 1, V]: the target's sampling distribution after the anchor and after each
    drafted slot (the last row gives the bonus token). One host read.
    """
    s = proposal.tokens_S.shape[0]
    q = dense_q(proposal, p_rows.shape[-1])
    x = proposal.tokens_S.view(s, 1)
    p_x = p_rows[:s].gather(1, x).squeeze(1)
    q_x = q.gather(1, x).squeeze(1)
    u = torch.rand(s, device=p_rows.device, generator=generator)
    keep = u * q_x < p_x  # u < p / q without dividing by a q of 0 (never drawn then)
    residual = (p_rows[:s] - q).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_rows[:s], residual)
    rows = torch.cat([residual, p_rows[s:]], 0)
    fallback = torch.multinomial(rows, 1, generator=generator).squeeze(1)
    host = torch.cat([keep.long(), proposal.tokens_S, fallback]).tolist()
    kept, drafted, fall = host[:s], host[s : 2 * s], host[2 * s :]
    acc = 0
    while acc < s and kept[acc]:
        acc += 1
    return [*drafted[:acc], fall[acc]], acc
