"""The compiled drafter step (inductor's kernels) captured in CUDA graphs: the drafts of
`--decode graphs --compile-drafter` are those of `--decode graphs` (fp32), and no replay
compiles again.

Run on a CUDA machine: pytest -m gpu tests/test_compiled_drafter_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from test_speculative import random_dflash
from test_speculative_gpu import cuda_target, dflash2_on_cuda, seeded_runs
from torch._dynamo.utils import counters

from dflash_trainer.eval.static_decode import StaticDFlashDrafter, StaticTargetRunner

pytestmark = pytest.mark.gpu


def dflash_on_cuda():
    """A tiny fp32 llama target and a DFlash drafter of block 5 for it, both on the GPU."""
    target = cuda_target("llama", torch.float32)
    return target, random_dflash(target, 5).model.to("cuda")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_graphs_of_the_compiled_step_draft_what_plain_graphs_draft(kind, temperature):
    """DFlash samples its drafts from its own distribution over the whole vocabulary at t > 0
    (a cumulative sum and a search per slot), DFlash2 walks its candidates: both compiled."""
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
