"""Sampling (temperature > 0, top-p): speculative output is an exact sample of the target.

The statistical test compares the joint distribution of the first three generated tokens
(t0 from the prefill, t1 and t2 from the first verify step) with the target's exact joint,
enumerated over a 4-token vocabulary. The drafter drafts the target's greedy continuation,
which the target accepts often (about 60% of slots here): an accept rule biased towards the
draft would over-sample greedy paths. Fixed seeds make the test deterministic; the same
samples must also REJECT two nearby wrong distributions, which shows the test has power.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_speculative import OracleDrafter
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.eval.drafting import Proposal, _inverse_cdf, rejection_verify
from dflash_trainer.eval.speculative import (
    DFlashBlockDrafter,
    generate,
    sample_tokens,
    target_probs,
    top_p_filter,
)
from dflash_trainer.target.model import FrozenTarget

V = 4
TEMPERATURE, TOP_P = 1.0, 0.8
SAMPLES = 2000
PROMPT = torch.tensor([1, 2, 3, 0, 1])


pytestmark = pytest.mark.usefixtures("one_thread")


def peaked_target() -> FrozenTarget:
    """A 1-layer llama over 4 tokens; a large init range gives peaked, varied distributions."""
    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=V,
        max_position_embeddings=64,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)
    return FrozenTarget(model, [0])


class MemoOracle(OracleDrafter):
    """The greedy-continuation oracle, memoised: the test revisits the same few prefixes."""

    def __init__(self, target: FrozenTarget, block_size: int):
        super().__init__(target, block_size)
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, ids, new_features):
        key = tuple(ids.tolist())
        if key not in self.memo:
            self.memo[key] = super().__call__(ids, new_features)
        return self.memo[key]


def exact_joint(target: FrozenTarget, depth: int, temperature: float, top_p: float) -> dict:
    """P(t0..t_{depth-1}) by enumerating every prefix with uncached forwards."""
    joint = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, p in joint.items():
            ids = torch.cat([PROMPT, torch.tensor(prefix, dtype=torch.long)])
            logits = target.model(input_ids=ids[None]).logits[0, -1:]
            probs = target_probs(logits, temperature, top_p)[0].tolist()
            for tok in range(V):
                nxt[(*prefix, tok)] = p * probs[tok]
        joint = nxt
    return joint


def chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square over cells with expected >= 5, the rest pooled into one cell."""
    cells = sorted(probs)
    big = [c for c in cells if probs[c] * n >= 5]
    small = [c for c in cells if 0 < probs[c] * n < 5]  # impossible cells are checked apart
    obs = [counts.get(c, 0) for c in big]
    exp = [probs[c] * n for c in big]
    if small:
        obs.append(sum(counts.get(c, 0) for c in small))
        exp.append(sum(probs[c] * n for c in small))
    o, e = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    half_dof = torch.tensor((len(obs) - 1) / 2, dtype=torch.float64)
    # Chi-square survival function = regularised upper incomplete gamma Q(dof/2, stat/2).
    return float(torch.special.gammaincc(half_dof, stat / 2))


def test_chi2_pvalue_matches_known_values():
    # 1 dof: P(X > 3.841) = 0.05; 3 dof: P(X > 7.815) = 0.05 (standard table values).
    assert abs(chi2_pvalue({0: 60, 1: 40}, {0: 0.5, 1: 0.5}, 100) - 0.0455) < 1e-3
    q = torch.special.gammaincc(torch.tensor(1.5, dtype=torch.float64), torch.tensor(7.815 / 2))
    assert abs(float(q) - 0.05) < 1e-3


def test_top_p_filter_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.1, 0.5, 0.25, 0.15], [0.7, 0.1, 0.1, 0.1]])
    out = top_p_filter(probs, 0.7)
    # Row 0: 0.5 < 0.7, then 0.25 crosses it and is kept; row 1: 0.7 alone reaches it.
    torch.testing.assert_close(out[0], torch.tensor([0.0, 0.5, 0.25, 0.0]) / 0.75)
    torch.testing.assert_close(out[1], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert top_p_filter(probs, 1.0) is probs


def test_temperature_zero_is_argmax_and_sampling_follows_the_generator():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    assert sample_tokens(logits, 0.0, 1.0, None).tolist() == [1, 0]
    a = sample_tokens(logits.repeat(50, 1), 1.0, 1.0, torch.Generator().manual_seed(3))
    b = sample_tokens(logits.repeat(50, 1), 1.0, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and len(set(a.tolist())) > 1


def test_speculative_sampling_keeps_the_target_distribution():
    target = peaked_target()
    drafter = MemoOracle(target, block_size=3)
    gen = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    accepted = []
    for _ in range(SAMPLES):
        g = generate(
            target,
            PROMPT,
            drafter,
            max_new_tokens=3,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            generator=gen,
        )
        key = tuple(g.tokens)
        counts[key] = counts.get(key, 0) + 1
        accepted += g.accepted
    # The draft is accepted often, so the accept branch is what is being tested.
    assert sum(a > 0 for a in accepted) / len(accepted) > 0.4

    exact = exact_joint(target, 3, TEMPERATURE, TOP_P)
    assert set(exact) == set(itertools.product(range(V), repeat=3))
    impossible = [c for c, p in exact.items() if p == 0 and counts.get(c, 0)]
    assert not impossible, f"sampled outside the top-p nucleus: {impossible}"
    assert chi2_pvalue(counts, exact, SAMPLES) > 1e-3

    # Power: the same samples are far from a colder target and from one without top-p.
    assert chi2_pvalue(counts, exact_joint(target, 3, 0.7, TOP_P), SAMPLES) < 1e-6
    no_top_p = exact_joint(target, 3, TEMPERATURE, 1.0)
    assert chi2_pvalue(counts, no_top_p, SAMPLES) < 1e-6


def test_target_only_sampling_is_reproducible_with_a_seeded_generator():
    target = peaked_target()
    runs = [
        generate(
            target,
            PROMPT,
            None,
            max_new_tokens=8,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            generator=torch.Generator().manual_seed(7),
        ).tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 8


# ---------------------------------------------------- drafts sampled from the drafter itself


def sampling_drafter(target: FrozenTarget, kind: str, block: int = 3) -> DFlashDrafter:
    """A random real drafter over the 4-token target: DFlash, or DFlash2 with a non-trivial
    convolution and selector (the selector's q depends on the previous drafted token)."""
    spec = DrafterSpec(
        hidden_size=16,
        vocab_size=V,
        target_hidden_size=16,
        num_target_hidden_layers=1,
        target_layer_ids=(0,),
        block_size=block,
        mask_token_id=V - 1,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        rope_theta=10000.0,
        layer_types=("full_attention",),
        sliding_window=None,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        kind=kind,
        conv_group_size=4,
        selector_rank=4,
        selector_top_k=3,
    )
    torch.manual_seed(5)
    model = DFlashDrafter(spec).eval()
    model.reset_parameters(std=0.3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 or kind == "dflash2":
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.slow  # 2,000 generations per case
@pytest.mark.parametrize(
    ("kind", "scale"), [("dflash", 1.0), ("dflash2", 1.0), ("dflash", 0.4), ("dflash2", 0.4)]
)
def test_sampled_drafts_with_rejection_sampling_keep_the_target_distribution(kind, scale):
    """Drafts drawn from the drafter's q (DFlash: softmax of its logits; DFlash2: the selector
    walk over its top-K) and verified by rejection sampling against that q: the output is
    still an exact sample of the target, also with the drafts at another temperature."""
    target = peaked_target()
    model = sampling_drafter(target, kind)
    block = DFlashBlockDrafter(
        model, target, draft_sampling="sample", draft_temperature_scale=scale
    )
    gen = torch.Generator().manual_seed(99)
    counts: dict[tuple[int, ...], int] = {}
    accepted = []
    for _ in range(SAMPLES):
        g = generate(
            target,
            PROMPT,
            block,
            max_new_tokens=3,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            generator=gen,
        )
        counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
        accepted += g.accepted
    # The accept branch is exercised (a sharper q of this random drafter is accepted less).
    assert sum(a > 0 for a in accepted) / len(accepted) > (0.15 if scale == 1 else 0.05)
    assert block.temperature == pytest.approx(TEMPERATURE * scale)  # the drafts' temperature
    exact = exact_joint(target, 3, TEMPERATURE, TOP_P)
    impossible = [c for c, p in exact.items() if p == 0 and counts.get(c, 0)]
    assert not impossible, f"sampled outside the top-p nucleus: {impossible}"
    assert chi2_pvalue(counts, exact, SAMPLES) > 1e-3
    assert chi2_pvalue(counts, exact_joint(target, 3, 0.7, TOP_P), SAMPLES) < 1e-6


def test_rejection_verify_is_exact_on_a_constructed_block():
    """One slot, p and q known: the committed token's law is p, whatever q is."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.7, 0.0]])
    gen = torch.Generator().manual_seed(0)
    n, counts, kept = 20000, torch.zeros(4), 0
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=gen)
        toks, acc = rejection_verify(Proposal(x, q, None), p, gen)
        counts[toks[0]] += 1
        kept += acc
    torch.testing.assert_close(counts / n, p[0], atol=0.015, rtol=0)
    # Acceptance is sum(min(p, q)) = 0.1 + 0.2 + 0.2.
    assert abs(kept / n - 0.5) < 0.015


@pytest.mark.parametrize("vocab", [1, 2, 4, 101, 4097, 49152])
def test_a_draft_over_the_vocabulary_is_the_inverse_cdf_index_of_its_uniform(vocab):
    """DFlash's draw (two levels of masked sums, no cumulative sum over the vocabulary: see
    _inverse_cdf) picks, for each uniform u, the token whose bin of the cumulative
    distribution holds u times the total (exact in float64, up to float32 rounding): an exact
    draw from q. Never a token of probability 0, also with u next to 1."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 32
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[torch.rand(rows, vocab, generator=gen) < 0.4] = -float("inf")  # q = 0 tokens
    logits[:, -1] = 0.0  # at least one token per row
    q = torch.softmax(logits, -1)
    cdf = torch.nn.functional.pad(q.double().cumsum(-1), (1, 0))  # cdf[i]: mass below token i
    for _ in range(8):
        u = torch.rand(rows, generator=gen)
        u[:2] = torch.tensor([1 - 2**-24, 2**-24])  # the largest and smallest u above 0
        x = _inverse_cdf(q, u)
        assert (q.gather(1, x[:, None]) > 0).all()
        where = u.double() * cdf[:, -1]
        lo, hi = cdf.gather(1, x[:, None]).squeeze(1), cdf.gather(1, x[:, None] + 1).squeeze(1)
        assert ((lo - 1e-6 <= where) & (where <= hi + 1e-6)).all()
