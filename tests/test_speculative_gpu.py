"""The speculative loop on CUDA: device generator, synchronised timing, bf16 numerics."""

from __future__ import annotations

import pytest
import torch
from test_speculative import OracleDrafter, make_target, prompt, random_dflash

from dflash_trainer.eval_report import lossless_check
from dflash_trainer.speculative import generate

pytestmark = pytest.mark.gpu


def cuda_target(kind: str, dtype: torch.dtype):
    target = make_target(kind)
    target.model.to("cuda", dtype)
    return target


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_cuda_fp32_greedy_is_lossless(kind):
    target = cuda_target(kind, torch.float32)
    p = prompt(5).cuda()
    base = generate(target, p, None, max_new_tokens=32)
    drafter = random_dflash(target, 4)
    drafter.model.cuda()
    for d in (drafter, OracleDrafter(target, 6, corrupt=0.25, seed=1)):
        g = generate(target, p, d, max_new_tokens=32)
        assert g.tokens == base.tokens
        assert g.decode_s > 0 and g.prefill_s > 0


def test_cuda_sampling_uses_a_device_generator_reproducibly():
    target = cuda_target("llama", torch.float32)
    runs = [
        generate(
            target,
            prompt(2).cuda(),
            OracleDrafter(target, 4),
            max_new_tokens=20,
            temperature=1.0,
            top_p=0.9,
            generator=torch.Generator(device="cuda").manual_seed(5),
        ).tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_cuda_bf16_mismatches_are_only_numerical_ties(kind):
    """In bf16 a B-token and a 1-token forward round differently; only near-ties may flip."""
    target = cuda_target(kind, torch.bfloat16)
    for seed in range(3):
        p = prompt(seed).cuda()
        base = generate(target, p, None, max_new_tokens=32, record_margins=True)
        g = generate(target, p, OracleDrafter(target, 6, corrupt=0.25), max_new_tokens=32)
        check = lossless_check(g, base)
        if not check["match"]:
            assert check["target_margin"] is not None and check["target_margin"] < 0.1, check
