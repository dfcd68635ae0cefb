"""Static-shape decoding (static_decode.py) against the dynamic loop it replaces.

On CPU the static shapes run eagerly ("static" mode): the fixed-size caches, the positions
written, the masks and the never-cropped rewind are exactly what a CUDA graph replays, so
token-for-token equality with the dynamic loop here checks the graph path's logic; the GPU
test (test_speculative_gpu.py) checks the captured graphs against it.
"""

from __future__ import annotations

import pytest
import torch
from test_evaluate import CONVERSATIONS, GREEDY, word_tokenizer
from test_speculative import (
    LAYER_IDS,
    OracleDrafter,
    drafter_spec,
    make_target,
    prompt,
    random_dflash,
    tiny_qwen3,
)

from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.drafting import Proposal
from dflash_trainer.eval.evaluate import evaluate_prompts
from dflash_trainer.eval.speculative import DFlashBlockDrafter, generate
from dflash_trainer.eval.static_decode import (
    DecodeEngines,
    StaticDFlashDrafter,
    StaticTargetRunner,
    resolve_decode,
    static_support,
)
from dflash_trainer.target.model import FrozenTarget

pytestmark = pytest.mark.usefixtures("one_thread")


def static_target(kind: str) -> FrozenTarget:
    if kind == "llama":
        return make_target("llama")
    # A full-attention qwen3: a static-path target besides llama, with sdpa or eager attention.
    return FrozenTarget(tiny_qwen3(seed=1, attn=kind.split("-")[1]), LAYER_IDS)


def static_pair(target: FrozenTarget, block: int, capacity: int = 96, seed: int = 0):
    dynamic = random_dflash(target, block, seed)
    runner = StaticTargetRunner(target, capacity, [(1, False), (block, True)], graphs=False)
    static = StaticDFlashDrafter(dynamic.model, target, capacity)
    return dynamic, static, runner


@pytest.mark.parametrize("kind", ["llama", "qwen3-sdpa", "qwen3-eager"])
@pytest.mark.parametrize("block", [2, 4, 7])
def test_static_loop_equals_the_dynamic_loop_token_for_token(kind, block):
    target = static_target(kind)
    for seed in range(2):
        dynamic, static, runner = static_pair(target, block, seed=seed)
        p = prompt(seed, n=5 + 4 * seed)
        want = generate(target, p, dynamic, max_new_tokens=40)
        got = generate(target, p, static, max_new_tokens=40, runner=runner)
        base = generate(target, p, None, max_new_tokens=40, runner=runner)
        assert got.tokens == want.tokens == base.tokens
        assert got.accepted == want.accepted  # the same drafts at every step
        assert got.target_forwards == len(got.accepted)


class PairedDrafter:
    """Runs two drafters on every step and checks they draft alike (with sampled drafts, the
    q each was drawn from too); the loop goes on with the first one's drafts."""

    needs_features = True

    def __init__(self, first: DFlashBlockDrafter, second: StaticDFlashDrafter):
        self.first, self.second = first, second
        self.block_size = first.block_size
        self.steps = 0

    def start(self, prompt_ids, features):
        self.first.start(prompt_ids, features)
        self.second.start(prompt_ids, features)

    def __call__(self, ids, new_features):
        a = self.first(ids, new_features)
        b = self.second(ids, new_features)
        if isinstance(a, Proposal):
            assert isinstance(b, Proposal), f"step {self.steps}"
            assert torch.equal(a.tokens_S, b.tokens_S), f"step {self.steps}"
            torch.testing.assert_close(a.q_SK, b.q_SK, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b), f"step {self.steps}: {a.tolist()} != {b.tolist()}"
        self.steps += 1
        return a


def test_static_drafts_equal_dynamic_drafts_when_some_steps_accept_and_some_reject():
    """An oracle target-side run gives partial acceptances of every length, so the static
    drafter overwrites rejected rows at every offset; its drafts stay the dynamic ones."""
    target = make_target("llama")
    dynamic, static, runner = static_pair(target, 5)
    paired = PairedDrafter(dynamic, static)
    g = generate(target, prompt(3), paired, max_new_tokens=50, runner=runner)
    assert paired.steps == len(g.accepted) >= 10


def test_static_runner_rewinds_partial_acceptances_of_every_length():
    target = make_target("llama")
    runner = StaticTargetRunner(target, 64, [(1, False), (6, False)], graphs=False)
    base = generate(target, prompt(5), None, max_new_tokens=45)
    for seed in range(3):
        oracle = OracleDrafter(target, 6, corrupt=0.3, seed=seed)
        g = generate(target, prompt(5), oracle, max_new_tokens=45, runner=runner)
        assert g.tokens == base.tokens
        assert len(set(g.accepted)) >= 3  # several acceptance lengths were rewound


def test_static_sampling_draws_what_the_dynamic_loop_draws():
    target = make_target("llama")
    dynamic, static, runner = static_pair(target, 4)
    runs = []
    for d, r in ((dynamic, None), (static, runner)):
        gen = torch.Generator().manual_seed(7)
        runs.append(
            generate(target, prompt(8), d, max_new_tokens=30, temperature=1.0, top_p=0.9,
                     generator=gen, runner=r).tokens
        )  # fmt: skip
    assert runs[0] == runs[1]


def test_a_smaller_block_than_trained_uses_fewer_slots():
    target = make_target("llama")
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_spec(6)).eval()
    model.reset_parameters(std=0.3)
    runner = StaticTargetRunner(target, 96, [(1, False), (3, True)], graphs=False)
    want = generate(target, prompt(2), DFlashBlockDrafter(model, target, 3), max_new_tokens=30)
    got = generate(
        target, prompt(2), StaticDFlashDrafter(model, target, 96, 3), max_new_tokens=30,
        runner=runner,
    )  # fmt: skip
    assert got.tokens == want.tokens and got.accepted == want.accepted


def test_targets_without_a_static_path_are_named_and_auto_falls_back():
    hybrid, sliding = make_target("qwen3_5"), make_target("sliding")
    assert "linear_attention" in (static_support(hybrid.model) or "")
    assert "sliding_attention" in (static_support(sliding.model) or "")
    assert static_support(make_target("llama").model) is None
    for t in (hybrid, sliding):
        assert resolve_decode("auto", t) == "eager"
        with pytest.raises(DFlashError, match="use --decode eager"):
            resolve_decode("static", t)
        with pytest.raises(DFlashError, match="static decoding"):
            StaticTargetRunner(t, 64, [(1, False)], graphs=False)
    llama = make_target("llama")
    assert resolve_decode("auto", llama) == "eager"  # CPU: graphs need CUDA
    assert resolve_decode("static", llama) == "static"
    with pytest.raises(DFlashError, match="needs a CUDA device"):
        resolve_decode("graphs", llama)
    with pytest.raises(DFlashError, match="choose one of"):
        resolve_decode("fast", llama)


def test_a_sequence_past_the_capacity_is_a_clear_error_and_engines_grow():
    target = make_target("llama")
    runner = StaticTargetRunner(target, 24, [(1, False)], graphs=False)
    with pytest.raises(DFlashError, match="exceed the cache's 24"):
        generate(target, prompt(0, n=20), None, max_new_tokens=10, runner=runner)
    engines = DecodeEngines(target, "static", None, 4, taps=False)
    engines.ensure(100)
    first = engines.runner
    assert engines.capacity >= 100 and first is not None
    engines.ensure(engines.capacity)  # fits: nothing rebuilt
    assert engines.runner is first
    engines.ensure(engines.capacity + 1)
    assert engines.runner is not first and engines.capacity > 1024 - 1


def test_evaluate_prompts_measures_the_same_in_static_and_eager_modes():
    target, tok = make_target("llama"), word_tokenizer()
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_spec(4)).eval()
    model.reset_parameters(std=0.3)
    runs = {
        mode: evaluate_prompts(model, target, tok, CONVERSATIONS, GREEDY, baseline=True, decode=mode)
        for mode in ("eager", "static")
    }  # fmt: skip
    eager, static = runs["eager"], runs["static"]
    assert (eager["decode"], static["decode"]) == ("eager", "static")
    assert [r["accepted"] for r in static["responses"]] == [
        r["accepted"] for r in eager["responses"]
    ]
    assert [r["text"] for r in static["responses"]] == [r["text"] for r in eager["responses"]]
    assert static["lossless_mismatches"] == 0 and static["tau"] == eager["tau"]
