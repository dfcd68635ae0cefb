"""The compiled drafter step (`dflash eval --compile-drafter`) against the uncompiled one.

On CPU the static shapes run eagerly (`--decode static`), compiled or not; both drafters are
stepped side by side through real speculative loops and must draft the same tokens at every
step, greedily and sampled (the same uniforms from generators of the same seed), for a DFlash
and a DFlash2 drafter. After the build's compile no step compiles again.

The cases compile with aot_eager: dynamo's same whole graph, functionalized as inductor gets
it, without the C++ build of inductor's kernels (15-20 s a compile on two cores, cold);
DFLASH_TEST_COMPILE_BACKEND=inductor runs them through inductor. One case always builds the
inductor kernels that the flag uses. The CUDA graph case is tests/test_compiled_drafter_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_dflash2_serving import dflash2_from
from test_evaluate import CONVERSATIONS, GREEDY, word_tokenizer
from test_speculative import make_target, prompt, random_dflash
from test_static_decode import PairedDrafter
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from dflash_trainer.cli import main
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval import compiled_step
from dflash_trainer.eval.evaluate import evaluate_prompts
from dflash_trainer.eval.speculative import generate
from dflash_trainer.eval.static_decode import DecodeEngines, StaticDFlashDrafter, StaticTargetRunner

pytestmark = pytest.mark.usefixtures("one_thread")

BACKEND = os.environ.get("DFLASH_TEST_COMPILE_BACKEND", "aot_eager")
BLOCK, CAPACITY = 5, 128


@pytest.fixture
def backend(monkeypatch):
    def use(name):
        monkeypatch.setattr(compiled_step, "COMPILE_BACKEND", name)

    use(BACKEND)
    return use


def drafter_module(kind: str, target):
    model = random_dflash(target, BLOCK).model
    return dflash2_from(model, seed=1) if kind == "dflash2" else model


class SideBySide(PairedDrafter):
    """Steps the uncompiled and the compiled drafter on the same inputs; their drafts (and
    at t > 0 the q each was drawn from) must agree at every step."""

    def set_sampling(self, temperature, generator):
        for d in (self.first, self.second):  # each its own generator, the same seed
            d.set_sampling(temperature, torch.Generator().manual_seed(11))


def check_same_drafts(kind: str, temperature: float) -> None:
    target = make_target("llama")
    model = drafter_module(kind, target)
    runner = StaticTargetRunner(target, CAPACITY, [(1, False), (BLOCK, True)], graphs=False)
    plain, compiled = (
        StaticDFlashDrafter(model, target, CAPACITY, temperature=temperature, compile_drafter=c)
        for c in (False, True)
    )
    assert compiled.compile_drafter, "the compile fell back"
    pair = SideBySide(plain, compiled)
    graphs_before = counters["stats"]["unique_graphs"]
    # The build compiled the step of this temperature; every step after reuses it.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            generate(
                target,
                prompt(seed, n=6 + 3 * seed),
                pair,
                max_new_tokens=30,
                temperature=temperature,
                generator=torch.Generator().manual_seed(seed),
                runner=runner,
            )
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert pair.steps >= 15


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_compiled_step_drafts_what_the_uncompiled_step_drafts(kind, temperature, backend):
    check_same_drafts(kind, temperature)


@pytest.mark.slow  # about 20 s with a cold inductor cache (its C++ build), 3 s warm
def test_the_inductor_compiled_dflash2_step_drafts_the_same(backend):
    """The kernels --compile-drafter runs: the sampled selector walk, which has the most ops."""
    backend("inductor")
    check_same_drafts("dflash2", 0.8)


def test_the_sampled_dflash_step_holds_no_scan_over_the_vocabulary(backend):
    """At t > 0 a DFlash step draws each slot from its q over the whole vocabulary. Inductor
    turns a cumulative sum over a row that long (SmolLM2: 49152 tokens) into its split scan,
    whose code generation failed on an H100 (torch 2.11: "InductorError: TypeError: list
    indices must be integers or slices, not NoneType", pytorch/pytorch#180221) and left the
    step uncompiled. The CPU backend has no scan kernel (it calls ATen), so the aten graph the
    step hands inductor is checked instead: no cumulative sum, no sorted search."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    backend(aot_autograd(fw_compiler=keep))
    target = make_target("llama")
    model = drafter_module("dflash", target)
    drafter = StaticDFlashDrafter(model, target, CAPACITY, temperature=0.8, compile_drafter=True)
    assert drafter.compile_drafter and len(graphs) == 1
    ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert not {op for op in ops if "cumsum" in op or "searchsorted" in op or "scan" in op}
    assert any("sum" in op for op in ops)  # the graph was read: it holds the masked sums


def test_a_failed_compile_warns_once_and_drafts_uncompiled(backend, capsys):
    def broken(gm, example_inputs):
        raise RuntimeError("no kernels today")

    backend(broken)
    target = make_target("llama")
    drafter = StaticDFlashDrafter(
        drafter_module("dflash2", target), target, CAPACITY, compile_drafter=True
    )
    assert not drafter.compile_drafter
    err = capsys.readouterr().err
    assert err.count("compiling the drafter step failed") == 1
    assert "no kernels today" in err and "continuing with the uncompiled step" in err
    assert "Traceback" not in err
    drafter.set_sampling(0.8, torch.Generator().manual_seed(0))
    drafter._replay()  # another draft mode: no second attempt, no second warning
    assert "failed" not in capsys.readouterr().err


def test_evaluate_prompts_with_a_compiled_drafter_measures_the_same(backend):
    target, tok = make_target("llama"), word_tokenizer()
    model = drafter_module("dflash2", target)
    runs = {
        c: evaluate_prompts(
            model, target, tok, CONVERSATIONS, GREEDY, baseline=True, decode="static",
            compile_drafter=c,
        )
        for c in (False, True)
    }  # fmt: skip
    assert (runs[False]["compiled_drafter"], runs[True]["compiled_drafter"]) == (False, True)
    for a, b in zip(runs[False]["responses"], runs[True]["responses"]):
        assert (a["text"], a["accepted"]) == (b["text"], b["accepted"])
    assert runs[True]["lossless_mismatches"] == 0


def test_compile_drafter_with_eager_decoding_is_a_clear_error(tmp_path, capsys):
    target = make_target("llama")
    model = random_dflash(target, BLOCK).model
    with pytest.raises(DFlashError, match=r"needs --decode static or graphs: --decode eager"):
        DecodeEngines(target, "eager", model, BLOCK, True, compile_drafter=True)
    # auto picks eager on a CPU, and says why
    with pytest.raises(DFlashError, match=r"--decode auto picks eager here \(no CUDA device\)"):
        DecodeEngines(target, "auto", model, BLOCK, True, compile_drafter=True)
    # The CLI says so before it reads the drafter or loads a model.
    argv = ["eval", "--drafter", str(tmp_path / "nowhere"), "--decode", "eager"]
    assert main([*argv, "--compile-drafter"]) == 2
    err = capsys.readouterr().err
    assert "--compile-drafter needs --decode static or graphs" in err
    assert "Traceback" not in err
