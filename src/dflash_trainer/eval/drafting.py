"""From a drafted block's hidden states to drafted tokens, and the rejection-sampling verify.

Shape legend: S = drafted slots (B - 1), H = hidden size, V = vocab, K = candidates.

How a block's tokens are chosen (`draft_tokens`, the same ops eagerly and inside a CUDA
graph, no host reads):

- DFlash, greedy: the argmax of each slot's logits.
- DFlash, sampled (t > 0 with draft sampling on): each slot drawn from q = softmax(z / t)
  over the vocabulary, independently (DFlash drafts every slot in one parallel pass).
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


def _inverse_cdf(q_SK: torch.Tensor, uniforms_S: torch.Tensor) -> torch.Tensor:
    """One index per row drawn from the row's distribution."""
    cdf = q_SK.cumsum(-1)
    # u times the total: a cumulative sum that ends a hair under 1 never lets u miss every bin.
    u = (uniforms_S.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1).contiguous()
    return torch.searchsorted(cdf.contiguous(), u).squeeze(-1).clamp(max=q_SK.shape[-1] - 1)


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
