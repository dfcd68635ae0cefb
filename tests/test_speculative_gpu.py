"""The speculative loop on CUDA: device generator, synchronised timing, bf16 numerics."""

from __future__ import annotations

import pytest
import torch
from test_speculative import OracleDrafter, make_target, prompt, random_dflash

from dflash_trainer.eval.report import lossless_check
from dflash_trainer.eval.speculative import generate

pytestmark = pytest.mark.gpu


def cuda_target(kind: str, dtype: torch.dtype):
    target = make_target(kind)
    target.model.to("cuda", dtype)
    return target


def dflash2_on_cuda():
    """A tiny fp32 llama target and a DFlash2 drafter of block 5 for it, both on the GPU."""
    from test_dflash2_serving import dflash2_from

    target = cuda_target("llama", torch.float32)
    return target, dflash2_from(random_dflash(target, 5).model.cpu(), seed=1).to("cuda")


def seeded_runs(target, drafter, runner, temperature: float) -> list:
    """Three 40-token generations from prompts and CUDA generators of seeds 0-2."""
    return [
        generate(
            target,
            prompt(s).cuda(),
            drafter,
            max_new_tokens=40,
            temperature=temperature,
            generator=torch.Generator("cuda").manual_seed(s),
            runner=runner,
        )
        for s in range(3)
    ]


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_replay_the_static_loop_exactly(dtype):
    """Captured graphs run the eager static shapes' kernels: the same tokens and drafts; in
    fp32 both equal the dynamic loop's greedy output."""
    from dflash_trainer.eval.static_decode import StaticDFlashDrafter, StaticTargetRunner

    target = cuda_target("llama", dtype)
    dflash = random_dflash(target, 5)
    dflash.model.to("cuda", dtype)
    runs = {}
    for graphs in (False, True):
        runner = StaticTargetRunner(target, 128, [(1, False), (5, True)], graphs=graphs)
        drafter = StaticDFlashDrafter(dflash.model, target, 128, graphs=graphs)
        runs[graphs] = [
            generate(target, prompt(s).cuda(), drafter, max_new_tokens=48, runner=runner)
            for s in range(3)
        ] + [generate(target, prompt(0).cuda(), None, max_new_tokens=48, runner=runner)]
    for eager, graphed in zip(runs[False], runs[True]):
        assert graphed.tokens == eager.tokens and graphed.accepted == eager.accepted
    if dtype == torch.float32:
        dynamic = generate(target, prompt(0).cuda(), None, max_new_tokens=48)
        assert runs[True][0].tokens == dynamic.tokens == runs[True][-1].tokens


def test_cuda_eval_picks_graphs_and_stays_lossless():
    from test_evaluate import CONVERSATIONS, GREEDY, word_tokenizer

    from dflash_trainer.eval.evaluate import evaluate_prompts

    target = cuda_target("llama", torch.float32)
    dflash = random_dflash(target, 4)
    dflash.model.cuda()
    res = evaluate_prompts(
        dflash.model, target, word_tokenizer(), CONVERSATIONS, GREEDY, baseline=True,
        decode="auto",
    )  # fmt: skip
    assert res["decode"] == "graphs"
    assert res["lossless_mismatches"] == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_graphs_replay_the_dflash2_walk_exactly(temperature):
    """The selector's walk (greedy, and sampled from uniforms drawn before the replay) inside
    a CUDA graph drafts what the eager static drafter drafts, step for step."""
    from dflash_trainer.eval.static_decode import StaticDFlashDrafter, StaticTargetRunner

    target, model = dflash2_on_cuda()
    runs = {}
    for graphs in (False, True):
        runner = StaticTargetRunner(target, 128, [(1, False), (5, True)], graphs=graphs)
        drafter = StaticDFlashDrafter(model, target, 128, graphs=graphs, temperature=temperature)
        runs[graphs] = seeded_runs(target, drafter, runner, temperature)
    for eager, graphed in zip(runs[False], runs[True]):
        assert graphed.tokens == eager.tokens and graphed.accepted == eager.accepted
