"""DFlash2 in the speculative loop: greedy is lossless, a DFlash2 drafter built on a DFlash
backbone serves exactly as DFlash before its first step, and the static (CUDA-graph-shaped)
drafter walks and samples exactly as the dynamic one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_speculative import make_target, prompt, random_dflash
from test_static_decode import PairedDrafter

from dflash_trainer.core.dflash2 import is_dflash2_tensor
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.eval.drafting import Proposal
from dflash_trainer.eval.speculative import DFlashBlockDrafter, generate
from dflash_trainer.eval.static_decode import StaticDFlashDrafter, StaticTargetRunner

pytestmark = pytest.mark.usefixtures("one_thread")


def dflash2_from(v1: DFlashDrafter, seed: int = 0, trained: bool = True) -> DFlashDrafter:
    """A DFlash2 drafter on v1's backbone; `trained`: random conv and selector weights."""
    spec = dataclasses.replace(
        v1.spec, kind="dflash2", conv_group_size=8, selector_rank=6, selector_top_k=5
    )
    model = DFlashDrafter(spec).eval()
    missing, _ = model.load_state_dict(v1.state_dict(), strict=False)
    assert all(is_dflash2_tensor(k) for k in missing)
    if trained:
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if is_dflash2_tensor(name):
                    p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("block", [2, 4, 8])
def test_dflash2_greedy_is_lossless_and_differs_from_dflash_once_trained(block):
    target = make_target("llama")
    differs = False
    for seed in range(2):
        v1 = random_dflash(target, block, seed)
        v2 = DFlashBlockDrafter(dflash2_from(v1.model, seed), target)
        p = prompt(seed)
        base = generate(target, p, None, max_new_tokens=40)
        g1 = generate(target, p, v1, max_new_tokens=40)
        g2 = generate(target, p, v2, max_new_tokens=40)
        assert g2.tokens == base.tokens == g1.tokens
        differs |= g1.accepted != g2.accepted
    assert differs or block == 2


def test_dflash2_on_a_dflash_backbone_serves_exactly_as_dflash():
    target = make_target("llama")
    for seed in range(3):
        v1 = random_dflash(target, 6, seed)
        v2 = DFlashBlockDrafter(dflash2_from(v1.model, trained=False), target)
        p = prompt(seed, n=9)
        g1 = generate(target, p, v1, max_new_tokens=48)
        g2 = generate(target, p, v2, max_new_tokens=48)
        assert g1.accepted == g2.accepted and g1.tokens == g2.tokens


def _static(model: DFlashDrafter, target, block: int, temperature: float = 0.0, scale: float = 1):
    runner = StaticTargetRunner(target, 128, [(1, False), (block, True)], graphs=False)
    static = StaticDFlashDrafter(
        model, target, 128, temperature=temperature, draft_temperature_scale=scale
    )
    return static, runner


def test_static_dflash2_walk_equals_the_dynamic_walk():
    target = make_target("llama")
    model = dflash2_from(random_dflash(target, 5).model, seed=1)
    dynamic = DFlashBlockDrafter(model, target)
    static, runner = _static(model, target, 5)
    paired = PairedDrafter(dynamic, static)
    g = generate(target, prompt(3), paired, max_new_tokens=50, runner=runner)
    assert paired.steps == len(g.accepted) >= 10
    assert g.tokens == generate(target, prompt(3), None, max_new_tokens=50).tokens


class Recording:
    """A drafter that records whether each step came back as a sampled `Proposal`."""

    needs_features = True

    def __init__(self, inner: DFlashBlockDrafter) -> None:
        self.inner, self.block_size = inner, inner.block_size
        self.sampled: list[bool] = []

    def set_sampling(self, temperature, generator):
        self.inner.set_sampling(temperature, generator)

    def start(self, prompt_ids, features):
        self.inner.start(prompt_ids, features)

    def __call__(self, ids, features):
        out = self.inner(ids, features)
        self.sampled.append(isinstance(out, Proposal))
        return out


@pytest.mark.parametrize(
    ("sampling", "scale"), [("auto", 1.0), ("sample", 1.0), ("greedy", 1.0), ("auto", 0.5)]
)
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_static_sampled_drafts_equal_the_dynamic_ones(kind, sampling, scale):
    """Same seeds, same q rows and tokens: the static step draws from the same uniforms (and
    at the same draft temperature)."""
    target = make_target("llama")
    model = random_dflash(target, 4).model
    if kind == "dflash2":
        model = dflash2_from(model, seed=2)
    runs = []
    for static in (False, True):
        runner = None
        if static:
            inner, runner = _static(model, target, 4, temperature=0.8, scale=scale)
            inner.draft_sampling = sampling
        else:
            inner = DFlashBlockDrafter(
                model, target, draft_sampling=sampling, draft_temperature_scale=scale
            )
        rec = Recording(inner)
        gen = torch.Generator().manual_seed(11)
        g = generate(
            target, prompt(4), rec, max_new_tokens=30, temperature=0.8, generator=gen, runner=runner
        )
        runs.append((g.tokens, g.accepted))
        sampled = sampling != "greedy"  # auto samples with both kinds
        assert rec.sampled and all(s == sampled for s in rec.sampled)
    assert runs[0] == runs[1]
