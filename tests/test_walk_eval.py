"""The held-out walk (walk_eval.py) is the greedy serving loop, replayed on a document."""

from __future__ import annotations

import pytest
import torch
from test_speculative import OracleDrafter, make_target, prompt, random_dflash

from dflash_trainer.eval.speculative import generate
from dflash_trainer.eval.walk import supervised_spans, walk_document, walked_tau

pytestmark = pytest.mark.usefixtures("one_thread")


def test_supervised_spans():
    m = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert supervised_spans(m) == [(1, 3), (5, 6), (7, 10)]
    assert supervised_spans(torch.zeros(4, dtype=torch.bool)) == []


@pytest.mark.parametrize("kind", ["llama", "sliding"])
def test_walk_over_the_served_text_takes_the_served_steps(kind):
    """A document made of a prompt and the loop's own greedy answer: walking it accepts, step
    by step, what the loop accepted (same drafter, same seed), the last step capped at the
    document's end where the loop may overshoot."""
    target = make_target(kind)
    block, max_new = 6, 40
    p = prompt(11, n=9)
    served = generate(target, p, OracleDrafter(target, block, 0.3, seed=4), max_new_tokens=max_new)
    assert len(set(served.accepted)) >= 3, served.accepted  # partial acceptances of many lengths
    ids = torch.cat([p, torch.tensor(served.tokens)])
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[p.numel() :] = True
    walked = walk_document(OracleDrafter(target, block, 0.3, seed=4), target, ids, mask)
    assert len(walked) == len(served.accepted)
    assert walked[:-1] == served.accepted[:-1]
    assert walked[-1] <= served.accepted[-1]


def test_walked_tau_of_a_real_drafter_pools_steps_and_keeps_the_training_mode():
    target = make_target("llama")
    adapter = random_dflash(target, 4)
    drafter = adapter.model.train()

    class Doc:
        def __init__(self, seed: int, n_prompt: int, n_answer: int) -> None:
            self.input_ids = prompt(seed, n_prompt + n_answer).numpy()
            self.loss_mask = (torch.arange(n_prompt + n_answer) >= n_prompt).numpy()

    docs = [Doc(1, 8, 20), Doc(2, 5, 30)]
    out = walked_tau(drafter, target, docs)
    assert drafter.training  # restored
    steps = [walk_document(adapter, target, torch.as_tensor(d.input_ids),
                           torch.as_tensor(d.loss_mask)) for d in docs]  # fmt: skip
    flat = [a for s in steps for a in s]
    assert out["steps"] == len(flat) and out["tau"] == pytest.approx(1 + sum(flat) / len(flat))
    # n supervised tokens take between ceil((n-1)/(B-1)) and n-1 steps (n-1 predictable slots).
    assert 7 <= len(steps[0]) <= 19 and 10 <= len(steps[1]) <= 29
    assert 1.0 <= out["tau"] <= 4.0


def test_candidate_walk_bounds_and_the_full_vocabulary_oracle():
    from test_speculative import VOCAB, make_target, prompt, random_dflash

    from dflash_trainer.eval.speculative import generate
    from dflash_trainer.eval.walk import candidate_walk

    target = make_target("llama")
    drafter = random_dflash(target, 5, seed=1).model
    answers = []
    for seed in range(3):
        p = prompt(seed)
        g = generate(target, p, None, max_new_tokens=30)
        answers.append((p.tolist(), g.tokens))
    out = candidate_walk(drafter, target, answers, k=3)
    assert 1.0 <= out["walked_tau"] <= out["oracle_tau"] <= 5.0
    for a1, ak in zip(out["recall_at_1"], out["recall_at_k"]):
        if a1 is not None:
            assert 0.0 <= a1 <= ak <= 1.0
    # Every token is a candidate when K is the vocabulary: each oracle step takes as many
    # slots as the answer has left.
    full = candidate_walk(drafter, target, answers, k=VOCAB)
    assert full["recall_at_k"][0] == 1.0
    steps = []
    for p, a in answers:
        at, end = len(p), len(p) + len(a)
        while at < end - 1:
            steps.append(min(4, end - 1 - at))
            at += steps[-1] + 1
    assert full["oracle_tau"] == pytest.approx((sum(steps) + len(steps)) / len(steps))
    assert full["walked_tau"] == out["walked_tau"]  # the drafter's own walk ignores K
