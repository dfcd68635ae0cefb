"""The compiled drafter step (inductor's kernels) captured in CUDA graphs: the drafts of
`--decode graphs --compile-drafter` are those of `--decode graphs` (fp32), and no replay
compiles again; and the sampled DFlash step over SmolLM2's vocabulary (bf16, block 16)
compiles after the greedy one, where inductor's split scan used to fail.

Run on a CUDA machine: pytest -m gpu tests/test_compiled_drafter_gpu.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_speculative import LAYER_IDS, drafter_spec, random_dflash
from test_speculative_gpu import cuda_target, dflash2_on_cuda, seeded_runs
from test_target import tiny_llama
from torch._dynamo.utils import counters

from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.eval.static_decode import StaticDFlashDrafter, StaticTargetRunner
from dflash_trainer.target.model import FrozenTarget

pytestmark = pytest.mark.gpu


def dflash_on_cuda():
    """A tiny fp32 llama target and a DFlash drafter of block 5 for it, both on the GPU."""
    target = cuda_target("llama", torch.float32)
    return target, random_dflash(target, 5).model.to("cuda")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_graphs_of_the_compiled_step_draft_what_plain_graphs_draft(kind, temperature):
    """DFlash samples its drafts from its own distribution over the whole vocabulary at t > 0
    (eval/drafting.py's _inverse_cdf), DFlash2 walks its candidates: both compiled."""
    target, model = dflash_on_cuda() if kind == "dflash" else dflash2_on_cuda()
    runs = {}
    for compiled in (False, True):
        runner = StaticTargetRunner(target, 128, [(1, False), (5, True)], graphs=True)
        drafter = StaticDFlashDrafter(
            model, target, 128, graphs=True, temperature=temperature, compile_drafter=compiled
        )
        assert drafter.compile_drafter == compiled, "the compile fell back"
        graphs_before = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            runs[compiled] = seeded_runs(target, drafter, runner, temperature)
        assert counters["stats"]["unique_graphs"] == graphs_before
    for plain, fused in zip(runs[False], runs[True]):
        assert fused.tokens == plain.tokens and fused.accepted == plain.accepted


SMOLLM2_VOCAB = 49152


def smollm2_shaped_dflash_on_cuda():
    """SmolLM2-135M's decode in small: a bf16 llama target of SmolLM2's vocabulary (49152)
    and a bf16 DFlash drafter of block 16 for it, both on the GPU."""
    model = tiny_llama(SMOLLM2_VOCAB)
    target = FrozenTarget(model.to("cuda", torch.bfloat16), LAYER_IDS)
    spec = replace(drafter_spec(16), vocab_size=SMOLLM2_VOCAB, mask_token_id=SMOLLM2_VOCAB - 1)
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec).eval()
    drafter.reset_parameters(std=0.3)
    return target, drafter.to("cuda", torch.bfloat16)


def test_a_dflash_step_over_smollm2s_vocabulary_compiles_at_t0_then_t1():
    """The H100 run that fell back (torch 2.11): the t=0 step compiled, then the t=1 step of
    the same drafter failed in inductor ("list indices must be integers or slices, not
    NoneType": the split scan of a cumulative sum over 49152 tokens per slot). Both steps
    compile now, and neither compiles again while the loop decodes."""
    target, model = smollm2_shaped_dflash_on_cuda()
    runner = StaticTargetRunner(target, 128, [(1, False), (16, True)], graphs=True)
    drafter = StaticDFlashDrafter(
        model, target, 128, graphs=True, temperature=0.0, compile_drafter=True
    )
    for temperature in (0.0, 1.0):  # t=1 compiles its step at the first draft
        runs = seeded_runs(target, drafter, runner, temperature)
        assert drafter.compile_drafter, f"the compile at t={temperature} fell back"
        graphs_before = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = seeded_runs(target, drafter, runner, temperature)
        assert counters["stats"]["unique_graphs"] == graphs_before
        assert [g.tokens for g in again] == [g.tokens for g in runs]  # same seeds
        assert all(len(g.tokens) == 40 for g in runs)
