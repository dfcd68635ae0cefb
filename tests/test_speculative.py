"""The speculative loop: lossless greedy output, acceptance accounting, hybrid-cache rewind.

Test drafters (real drafters, not mocks of the loop): an oracle that drafts the target's own
greedy continuation (computed without any cache, independently of the loop), a wrong drafter
that never drafts the target's token, and a noisy oracle that breaks the continuation at random
slots, so partial acceptances (the case that needs a cache rewind) happen at every length.
"""

from __future__ import annotations

import pytest
import torch
from test_target import tiny_hybrid, tiny_llama
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.eval.speculative import DFlashBlockDrafter, Generation, generate
from dflash_trainer.target.model import FrozenTarget

VOCAB = 101
LAYER_IDS = (0, 2)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_qwen3(seed: int = 0, attn: str | None = None, **overrides) -> torch.nn.Module:
    """A tiny qwen3 (full attention unless `overrides` add sliding layers)."""
    cfg = AutoConfig.for_model(
        "qwen3",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        **overrides,
    )
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


def tiny_sliding() -> torch.nn.Module:
    """A tiny qwen3 whose second layer is sliding-window attention (window 5)."""
    return tiny_qwen3(
        use_sliding_window=True,
        sliding_window=5,
        layer_types=["full_attention", "sliding_attention"] * 2,
    )


TARGETS = {"llama": tiny_llama, "qwen3_5": tiny_hybrid, "sliding": tiny_sliding}


def make_target(kind: str) -> FrozenTarget:
    return FrozenTarget(TARGETS[kind](), LAYER_IDS)


def drafter_spec(block: int) -> DrafterSpec:
    return DrafterSpec(
        hidden_size=32,
        vocab_size=VOCAB,
        target_hidden_size=32,
        num_target_hidden_layers=4,
        target_layer_ids=LAYER_IDS,
        block_size=block,
        mask_token_id=VOCAB - 1,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        rope_theta=10000.0,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=5,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
    )


def random_dflash(target: FrozenTarget, block: int, seed: int = 0) -> DFlashBlockDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(drafter_spec(block)).eval()
    # std 0.02 init drafts one constant token; larger weights give varied drafts.
    model.reset_parameters(std=0.3)
    return DFlashBlockDrafter(model, target)


def greedy_continuation(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The target's next n greedy tokens, by full forwards without a cache."""
    seq = ids.clone()
    for _ in range(n):
        nxt = model(input_ids=seq[None]).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq[ids.numel() :]


class OracleDrafter:
    """Drafts the target's own greedy continuation; `corrupt` replaces slots by wrong tokens.

    corrupt: "none" (tau = block size at temperature 0), "all" (tau = 1), or a probability
    per slot of drafting a wrong token (seeded), for partial acceptances of every length.
    With `needs_features`, it also records the feature stream the loop hands a drafter.
    """

    def __init__(
        self,
        target: FrozenTarget,
        block_size: int,
        corrupt: str | float = "none",
        seed: int = 0,
        needs_features: bool = False,
    ):
        self.model = target.model
        self.block_size = block_size
        self.corrupt = corrupt
        self.gen = torch.Generator().manual_seed(seed)
        self.needs_features = needs_features
        self.features: list[torch.Tensor] = []

    def start(self, prompt_ids, features):
        self.features = [] if features is None else [features]

    def __call__(self, ids, new_features):
        if new_features is not None:
            self.features.append(new_features)
        drafts = greedy_continuation(self.model, ids, self.block_size - 1)
        if self.corrupt == "all":
            wrong = torch.ones(drafts.shape, dtype=torch.bool)
        elif self.corrupt == "none":
            wrong = torch.zeros(drafts.shape, dtype=torch.bool)
        else:
            wrong = torch.rand(drafts.shape, generator=self.gen) < float(self.corrupt)
        return torch.where(wrong.to(drafts.device), (drafts + 1) % VOCAB, drafts)


def prompt(seed: int, n: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed))


def check_accounting(g: Generation, max_new: int) -> None:
    # Every step commits accepted + 1 tokens; the last step may overshoot max_new_tokens.
    produced = 1 + sum(a + 1 for a in g.accepted)
    assert len(g.tokens) == min(produced, max_new)
    assert all(0 <= a < g.block_size for a in g.accepted)


@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_lossless_greedy_with_a_random_dflash_drafter(block):
    target = make_target("llama")
    for seed in range(2):
        p = prompt(seed)
        base = generate(target, p, None, max_new_tokens=40)
        spec = generate(target, p, random_dflash(target, block, seed), max_new_tokens=40)
        assert spec.tokens == base.tokens
        check_accounting(spec, 40)
        assert base.accepted == [0] * 39
        assert spec.target_forwards == len(spec.accepted)


@pytest.mark.parametrize("block", [2, 4, 8])
def test_lossless_greedy_hybrid_target_with_a_random_dflash_drafter(block):
    target = make_target("qwen3_5")
    p = prompt(3)
    base = generate(target, p, None, max_new_tokens=24)
    spec = generate(target, p, random_dflash(target, block), max_new_tokens=24)
    assert spec.tokens == base.tokens
    check_accounting(spec, 24)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5", "sliding"])
def test_lossless_greedy_with_partial_acceptances(kind):
    """Acceptance lengths spread over 0..B-1 exercise every crop / restore + re-feed."""
    target = make_target(kind)
    block, max_new = 6, 48
    p = prompt(5, n=9)  # the sliding layer's window (5) is exceeded from the start
    base = generate(target, p, None, max_new_tokens=max_new)
    drafter = OracleDrafter(target, block, corrupt=0.25, seed=1)
    spec = generate(target, p, drafter, max_new_tokens=max_new)
    assert spec.tokens == base.tokens
    check_accounting(spec, max_new)
    assert len(set(spec.accepted)) >= 3, spec.accepted  # otherwise the test proves little
    partial = sum(a < block - 1 for a in spec.accepted)
    refeeds = partial if kind == "qwen3_5" else 0
    assert spec.target_forwards == len(spec.accepted) + refeeds


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_features_given_to_the_drafter_are_those_of_the_committed_tokens(kind):
    """Concatenated over the run, the stream equals one uncached forward of the committed text."""
    target = make_target(kind)
    drafter = OracleDrafter(target, 5, corrupt=0.3, seed=2, needs_features=True)
    p = prompt(7)
    g = generate(target, p, drafter, max_new_tokens=30)
    stream = torch.cat(drafter.features)
    committed = torch.cat([p, torch.tensor(g.tokens)])[: stream.shape[0]]
    # The last call saw the features of every token before its anchor.
    assert stream.shape[0] >= p.numel() + len(drafter.features) - 2
    want = target.forward_documents([committed], need_final=False).features_TF
    torch.testing.assert_close(stream, want, atol=1e-4, rtol=1e-4)


class RecordingDFlash(DFlashBlockDrafter):
    """Keeps what each step saw, to recompute its drafts from scratch afterwards."""

    calls: list[tuple[torch.Tensor, torch.Tensor]]

    def start(self, prompt_ids, features):
        self.calls = []
        super().start(prompt_ids, features)

    def __call__(self, ids, new_features):
        drafts = super().__call__(ids, new_features)
        self.calls.append((ids.clone(), drafts.clone()))
        return drafts


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_dflash_drafts_equal_a_from_scratch_drafter_step(kind):
    target = make_target(kind)
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_spec(4)).eval()
    model.reset_parameters(std=0.3)
    drafter = RecordingDFlash(model, target)
    generate(target, prompt(11), drafter, max_new_tokens=20)
    assert len(drafter.calls) >= 4
    w = target.lm_head_weight
    mask = target.embed(torch.tensor([VOCAB - 1]))
    for ids, drafts in drafter.calls:
        ctx = ids[:-1]
        feats = target.forward_documents([ctx], need_final=False).features_TF
        cache = model.new_cache()
        model.extend_cache(cache, feats, torch.arange(ctx.numel()))
        block = torch.cat([target.embed(ids[-1:]), mask.expand(3, -1)])
        want = (model.step(cache, block, ctx.numel())[1:] @ w.t()).argmax(-1)
        assert torch.equal(drafts, want)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_oracle_drafter_accepts_whole_blocks(kind):
    target = make_target(kind)
    block = 4 if kind == "qwen3_5" else 8
    max_new = 1 + 3 * block
    g = generate(target, prompt(1), OracleDrafter(target, block), max_new_tokens=max_new)
    assert g.accepted == [block - 1] * 3  # tau = block size at every step
    assert g.target_forwards == 3  # no re-feed: nothing to rewind


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_wrong_drafter_accepts_nothing(kind):
    target = make_target(kind)
    base = generate(target, prompt(2), None, max_new_tokens=10)
    g = generate(target, prompt(2), OracleDrafter(target, 4, "all"), max_new_tokens=10)
    assert g.accepted == [0] * 9  # tau = 1: one token per target forward
    assert g.tokens == base.tokens


def test_generation_stops_at_a_stop_id_in_the_middle_of_a_block():
    target = make_target("llama")
    p = prompt(4)
    base = generate(target, p, None, max_new_tokens=30)
    stop = base.tokens[9]
    first = base.tokens.index(stop)
    for drafter in (None, OracleDrafter(target, 8)):
        g = generate(target, p, drafter, max_new_tokens=30, stop_ids=[stop])
        assert g.tokens == base.tokens[: first + 1]
        assert g.stop_reason == "stop_id"
    full = generate(target, p, None, max_new_tokens=30, stop_ids=[VOCAB - 1])
    assert full.stop_reason == "max_new_tokens"


def test_one_new_token_needs_no_decode_step():
    target = make_target("llama")
    base = generate(target, prompt(0), None, max_new_tokens=1)
    g = generate(target, prompt(0), random_dflash(target, 4), max_new_tokens=1)
    assert g.tokens == base.tokens and len(g.tokens) == 1
    assert g.accepted == [] and g.target_forwards == 0


def test_greedy_margins_are_the_target_top2_gaps():
    target = make_target("llama")
    p = prompt(6)
    g = generate(target, p, None, max_new_tokens=6, record_margins=True)
    assert g.margins is not None and len(g.margins) == 6
    full = torch.cat([p, torch.tensor(g.tokens)])
    logits = target.model(input_ids=full[None]).logits[0, p.numel() - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    torch.testing.assert_close(torch.tensor(g.margins), top2[:, 0] - top2[:, 1], atol=1e-4, rtol=0)


def test_block_size_above_the_trained_one_is_refused():
    from dflash_trainer.errors import DFlashError

    target = make_target("llama")
    model = DFlashDrafter(drafter_spec(4))
    with pytest.raises(DFlashError, match=r"must be in 2\.\.4"):
        DFlashBlockDrafter(model, target, block_size=8)
