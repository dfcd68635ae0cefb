"""Held-out acceptance walked the way greedy serving walks it, without generating.

Why: the in-batch tau is a mean over uniformly placed anchors, each position counted once.
Serving counts tokens per step, and one step covers a whole accepted run, so it takes many
steps where drafting is hard and few where it is easy; its tau is lower for the same drafter
on the same text (the SmolLM2 H200 sweep's best drafter on held-out documents: 2.76 uniform
against 2.12 walked, benchmarks/smollm2-135m_h200_202612.md). On a held-out document whose
answers are the target's own greedy output (regenerated data), the walk below is exactly what
greedy speculative decoding does: draft from the anchor, accept the longest prefix that
equals the target's greedy predictions, count the accepted tokens plus the target's bonus
token, move the anchor to the first rejected slot. It costs one target forward per document instead of one per step, and
uses the serving drafter path (`DFlashBlockDrafter`, cached context K/V).

Each supervised stretch of a document (an assistant turn) is walked on its own, its first
token being the anchor the prefill would produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.speculative import DFlashBlockDrafter
from dflash_trainer.target.model import FrozenTarget


def supervised_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of every run of True in a 1-D bool mask."""
    m = loss_mask.to(torch.int8)
    edges = torch.diff(torch.cat([m.new_zeros(1), m, m.new_zeros(1)]))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends))


@torch.no_grad()
def teacher_forced(target: FrozenTarget, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tapped features [T, F], target greedy prediction of token t+1 at each t [T]) of one
    document, from one uncached forward."""
    out = target.forward_documents([ids], need_final=True)
    assert out.final_hidden_TH is not None
    return out.features_TF, target.argmax_at(out.final_hidden_TH).to(ids.device)


def accepted_run(drafts: torch.Tensor, greedy: torch.Tensor, anchor: int, limit: int) -> int:
    """Drafts accepted from `anchor`: the longest prefix (at most `limit`) equal to the
    target's greedy predictions at anchor, anchor+1, ..."""
    run = 0
    while run < limit and int(drafts[run]) == int(greedy[anchor + run]):
        run += 1
    return run


@torch.no_grad()
def walk_document(
    adapter: DFlashBlockDrafter,
    target: FrozenTarget,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    max_answer_tokens: int | None = None,
) -> list[int]:
    """Accepted drafts (0..B-1) of every step of the walk over one document."""
    ids = input_ids.to(target.device).long().view(-1)
    features, greedy = teacher_forced(target, ids)
    block = adapter.block_size
    accepted: list[int] = []
    for start, end in supervised_spans(loss_mask.view(-1)):
        if start == 0:  # no context to draft from (never so for a rendered chat)
            continue
        if max_answer_tokens is not None:
            end = min(end, start + max_answer_tokens)
        # As in serving: the drafter's context starts as the prompt's features and grows by
        # the features of the anchor and the accepted tokens after each step.
        adapter.start(ids[:start], features[:start])
        a, prev = start, start
        while a < end - 1:
            drafts = adapter(ids[: a + 1], features[prev:a] if a > prev else None)
            assert isinstance(drafts, torch.Tensor), "the walk drafts greedily"
            prev = a
            # Only slots whose label lies in the stretch count.
            run = accepted_run(drafts, greedy, a, min(block - 1, end - 1 - a))
            accepted.append(run)
            a += run + 1
    return accepted


def walked_tau(
    drafter: nn.Module,
    target: FrozenTarget,
    documents: Sequence[Any],
    max_answer_tokens: int | None = None,
) -> dict[str, float]:
    """Tokens per step (accepted + 1, pooled over steps) of the walk over `documents`.

    `documents` hold numpy or torch `input_ids` and `loss_mask` (prepared-data Documents).
    The drafter is put in eval mode for the walk (no feature noise) and restored after.
    """
    was_training = drafter.training
    drafter.eval()
    try:
        adapter = DFlashBlockDrafter(drafter, target)
        steps: list[int] = []
        for doc in documents:
            ids = torch.as_tensor(doc.input_ids).long()
            mask = torch.as_tensor(doc.loss_mask).bool()
            steps += walk_document(adapter, target, ids, mask, max_answer_tokens)
    finally:
        drafter.train(was_training)
    n = len(steps)
    return {
        "documents": float(len(documents)),
        "steps": float(n),
        "tau": (sum(steps) + n) / n if n else float("nan"),
    }


# ------------------------------------------------------------- candidates along the walk


@torch.no_grad()
def _block_candidates(
    adapter: DFlashBlockDrafter, ids: torch.Tensor, new_feats: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafted tokens [S], top-k candidates [S, k]) of the block anchored at ids[-1]."""
    drafts = adapter(ids, new_feats)
    assert isinstance(drafts, torch.Tensor), "candidates are walked greedily"
    hidden = adapter.last_hidden
    assert hidden is not None
    w = adapter.target.lm_head_weight
    cand = (hidden[1:].to(w.dtype) @ w.t()).topk(k, dim=-1).indices
    return drafts, cand


def _walk_span(
    adapter: DFlashBlockDrafter,
    ids: torch.Tensor,
    features: torch.Tensor,
    greedy: torch.Tensor,
    span: tuple[int, int],
    k: int,
    oracle: bool,
    tally: dict[str, Any],
) -> list[int]:
    """Accepted drafts per step over one answer; the oracle accepts a slot whenever the
    target's token is among its k candidates, the drafter when its own draft is it."""
    start, end = span
    adapter.start(ids[:start], features[:start])
    a, prev, steps = start, start, []
    block = adapter.block_size
    while a < end - 1:
        drafts, cand = _block_candidates(
            adapter, ids[: a + 1], features[prev:a] if a > prev else None, k
        )
        prev = a
        limit = min(block - 1, end - 1 - a)
        want = greedy[a : a + limit]
        hit_k = (cand[:limit] == want[:, None]).any(-1).tolist()
        hit_1 = (cand[:limit, 0] == want).tolist()
        right = (drafts[:limit] == want).tolist()
        ok = hit_k if oracle else right
        run = 0
        while run < limit and ok[run]:
            run += 1
        if not oracle:  # recall of the slots the drafter's walk reached
            for s in range(min(run + 1, limit)):
                tally["reached"][s] += 1
                tally["at1"][s] += int(hit_1[s])
                tally["atk"][s] += int(hit_k[s])
        steps.append(run)
        a += run + 1
    return steps


def candidate_walk(
    drafter: nn.Module,
    target: FrozenTarget,
    answers: Sequence[tuple[list[int], list[int]]],
    k: int,
) -> dict[str, Any]:
    """Along the target's own greedy answers ((prompt ids, answer ids) pairs): the drafter's
    walked tau, the tau of an oracle that picks the target's token whenever it is among
    each slot's top-k candidates, and per-slot recall@1 / recall@k of the slots the walk
    reaches (each conditioned on the earlier slots being right). With DFlash2 the drafts
    are the selector's walk; the candidates are the backbone's top-k either way."""
    adapter = DFlashBlockDrafter(drafter, target)
    vocab = int(target.lm_head_weight.shape[0])
    if k > vocab:  # top-k of fewer than k logits: torch's "selected index k out of range"
        raise DFlashError(f"--candidates {k} is more than the target's vocabulary of {vocab}")
    s = adapter.block_size - 1
    tally: dict[str, Any] = {"reached": [0] * s, "at1": [0] * s, "atk": [0] * s}
    walked: list[int] = []
    oracle: list[int] = []
    for prompt, answer in answers:
        if len(answer) < 2:
            continue
        ids = torch.tensor(prompt + answer, dtype=torch.long, device=target.device)
        features, greedy = teacher_forced(target, ids)
        span = (len(prompt), ids.numel())
        walked += _walk_span(adapter, ids, features, greedy, span, k, False, tally)
        oracle += _walk_span(adapter, ids, features, greedy, span, k, True, tally)

    def tau(steps: list[int]) -> float:
        return (sum(steps) + len(steps)) / len(steps) if steps else float("nan")

    reached = tally["reached"]
    return {
        "k": k,
        "responses": len(answers),
        "walked_tau": tau(walked),
        "oracle_tau": tau(oracle),
        "recall_at_1": [a / r if r else None for a, r in zip(tally["at1"], reached)],
        "recall_at_k": [a / r if r else None for a, r in zip(tally["atk"], reached)],
        "slots_reached": reached,
    }
