"""The static batch engine (data/engine.py) against HF `generate`, on CPU in fp32.

The CPU runs the engine's static path eagerly: the fixed caches, per-row positions, masks,
refills and length buckets are exactly what a CUDA graph replays, so token-for-token equality
with HF `generate` here checks the graph path's logic; tests/test_regen_engine_gpu.py checks
the captured graphs against this eager path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_data_support import tiny_llama
from test_speculative import tiny_qwen3, tiny_sliding
from test_target import tiny_hybrid

from dflash_trainer.data.engine import StaticBatchEngine, engine_notice
from dflash_trainer.data.hf_generate import per_prompt_generate
from dflash_trainer.data.regenerate import GenerationSettings, cut_at_stop
from dflash_trainer.data.sampling import item_key, keyed_uniform, pick_tokens
from dflash_trainer.errors import DFlashError

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [3, 41, 7, 130, 5, 5, 260, 22, 64, 9]  # 260 + new tokens: a second cache bucket


def _prompts(vocab: int, lengths: list[int] = LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _staggered_stops(model: Any, prompts: list[list[int]], new: int) -> list[int]:
    """Stop ids taken from the model's own greedy answers at different depths, so that rows
    finish at different steps (a random model rarely says its EOS)."""
    free = per_prompt_generate(model, prompts, GenerationSettings("m", max_new_tokens=new), [], 0)

    def depths(stops: set[int]) -> set[int]:
        return {cut_at_stop(out, sorted(stops))[2] for out in free}

    # Greedily add candidate stop ids (each row's token at a different depth) while they add
    # a new finishing depth, so the test does not hinge on one lucky pick of random weights.
    chosen: set[int] = set()
    for i, out in enumerate(free):
        for d in range((3 * i) % new, new):
            if len(depths(chosen | {out[d]})) > len(depths(chosen)):
                chosen.add(out[d])
                break
    return sorted(chosen)


def _hf(model: Any, prompts: list[list[int]], new: int, stops: list[int]) -> list[list[int]]:
    outs = per_prompt_generate(
        model, prompts, GenerationSettings("m", max_new_tokens=new), stops, 0
    )
    return [o[: cut_at_stop(o, stops)[2]] for o in outs]


def _lively(model: Any) -> Any:
    """Scale the random weights up: at the default init the tiny llama repeats one token
    forever, so no choice of stop ids makes its rows finish at different depths."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8)
    return model


MODELS = {
    "llama-sdpa": lambda: _lively(tiny_llama(400)),
    "qwen3-eager": lambda: tiny_qwen3(seed=1, attn="eager"),
    "qwen3-sdpa": lambda: tiny_qwen3(seed=2, attn="sdpa"),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_greedy_answers_equal_hf_generate_with_refills_and_buckets(kind: str) -> None:
    model = MODELS[kind]()
    vocab = model.config.vocab_size
    prompts, new = _prompts(vocab), 24
    stops = _staggered_stops(model, prompts, new)
    ref = _hf(model, prompts, new, stops)
    engine = StaticBatchEngine(model, GenerationSettings("m", max_new_tokens=new), stops, 0, rows=3)
    outs = engine.generate(prompts)
    assert outs == ref
    assert len({len(o) for o in ref}) >= 3  # rows stopped at several depths
    assert engine.stats.prefills > 3  # rows were refilled as they finished
    assert [length for _, length in engine.stats.shapes] == [256, 512]  # two length buckets
    # A second call on the same engine (the next regeneration round) reuses the shapes,
    # including the first length's, built before the second: no rebuild, no recapture.
    builds = engine.stats.builds
    assert engine.generate(prompts[:4]) == ref[:4]
    assert engine.generate(prompts) == ref
    assert engine.stats.builds == builds


def test_one_row_and_many_rows_give_the_same_answers() -> None:
    model = tiny_llama(400)
    prompts = _prompts(400, [12, 3, 30, 8, 8, 17])
    settings = GenerationSettings("m", max_new_tokens=10)
    one = StaticBatchEngine(model, settings, [5], 0, rows=1).generate(prompts)
    wide = StaticBatchEngine(model, settings, [5], 0, rows=8, refill_rows=4).generate(prompts)
    # Prefill widths rounded up to 64 columns (the GPU default): more padding, same answers.
    aligned = StaticBatchEngine(model, settings, [5], 0, rows=4, prefill_align=64)
    assert one == wide == aligned.generate(prompts) == _hf(model, prompts, 10, [5])


def test_sampling_is_reproducible_and_independent_of_the_batch() -> None:
    model = tiny_llama(400)
    prompts = _prompts(400, [4, 20, 9, 9, 50])
    keys = [item_key(7, i) for i in range(len(prompts))]
    settings = GenerationSettings("m", temperature=1.0, top_p=0.9, max_new_tokens=12, seed=7)
    a = StaticBatchEngine(model, settings, [], 0, rows=2).generate(prompts, keys)
    b = StaticBatchEngine(model, settings, [], 0, rows=5).generate(prompts, keys)
    alone = [StaticBatchEngine(model, settings, [], 0, rows=1).generate([p], [k])[0]
             for p, k in zip(prompts, keys)]  # fmt: skip
    assert a == b == alone
    other = StaticBatchEngine(model, settings, [], 0, rows=2).generate(
        prompts, [item_key(8, i) for i in range(len(prompts))]
    )
    assert other != a
    greedy = StaticBatchEngine(model, GenerationSettings("m", max_new_tokens=12), [], 0, rows=2)
    assert greedy.generate(prompts) != a  # temperature 1 does sample


def test_keyed_draws_follow_the_distribution_and_its_nucleus() -> None:
    u = keyed_uniform(torch.arange(4), torch.tensor([0, 1, 2, 3]), 50_000)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20_000, 4)
    keys, steps = torch.arange(20_000), torch.zeros(20_000, dtype=torch.long)
    drawn = pick_tokens(logits, 1.0, 1.0, keys, steps)
    freq = torch.bincount(drawn, minlength=4).float() / 20_000
    assert torch.allclose(freq, probs, atol=0.015), freq
    nucleus = pick_tokens(logits, 1.0, 0.7, keys, steps)  # 0.5 + 0.3 reach 0.7: two tokens
    assert set(nucleus.tolist()) == {0, 1}
    share0 = (nucleus == 0).float().mean().item()
    assert abs(share0 - 0.5 / 0.8) < 0.02
    assert torch.equal(
        pick_tokens(logits[:5], 0.0, 1.0, keys[:5], steps[:5]), torch.zeros(5).long()
    )


def test_targets_without_a_static_cache_are_refused_with_the_reason() -> None:
    settings = GenerationSettings("m", max_new_tokens=4)
    for model, why in ((tiny_sliding(), "sliding"), (tiny_hybrid(), "layer types")):
        with pytest.raises(DFlashError, match=why):
            StaticBatchEngine(model, settings, [1], 0)
        assert why in (engine_notice(model) or "") or "cpu" in (engine_notice(model) or "")
    assert "cpu" in (engine_notice(tiny_llama(400)) or "")


def test_auto_backend_falls_back_to_hf_with_a_notice(capsys: pytest.CaptureFixture[str]) -> None:
    from dflash_trainer.data.cli import _engine_or_hf

    assert _engine_or_hf("auto", tiny_llama(400)) == "hf"
    assert "HF batched path: the target is on cpu" in capsys.readouterr().err
    assert _engine_or_hf("static", tiny_llama(400)) == "static"


@pytest.mark.slow
def test_smollm2_greedy_answers_equal_hf_generate() -> None:
    from test_data_support import smollm2_tokenizer

    from dflash_trainer.data.loading import load_causal_lm
    from dflash_trainer.data.regenerate import stop_ids
    from dflash_trainer.data.template import ChatTemplate

    tok = smollm2_tokenizer()
    model = load_causal_lm("asset:smollm2-135m-instruct", "cpu", "float32")
    chat = ChatTemplate.probe(tok)
    questions = [
        "What is 2+2?",
        "Write a haiku about the sea.",
        "Explain in detail how a hash table handles collisions, with an example in Python. " * 3,
        "Hi",
        "Name three prime numbers.",
    ]
    prompts = [chat.prompt_ids([{"role": "user", "content": q}]) for q in questions]
    stops = stop_ids(tok, chat, model)
    ref = _hf(model, prompts, 16, stops)
    engine = StaticBatchEngine(model, GenerationSettings("s", max_new_tokens=16), stops, 0, rows=2)
    assert engine.generate(prompts) == ref
    assert any(len(r) < 16 for r in ref)  # at least one answer stopped by itself


def test_the_speed_benchmark_runs_and_writes_its_keys(tmp_path: Path) -> None:
    import json

    from benchmark_scripts import load_benchmark
    from test_data_support import tiny_tokenizer, write_jsonl

    bench = load_benchmark("regenerate_speed")
    tok = tiny_tokenizer()
    model_dir = tmp_path / "model"
    tiny_llama(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": f"tell me {i} " * i} for i in range(1, 9)]
    )
    out = tmp_path / "speed.json"
    argv = [
        "--model",
        str(model_dir),
        "--input",
        str(prompts),
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    assert (
        bench.main([*argv, "--max-prompts", "8", "--max-new-tokens", "4", "--hf-prompts", "3"]) == 0
    )
    r = json.loads(out.read_text())
    assert r["prompts"] == 8 and r["new_tokens"] == 4 and r["hf_prompts"] == 3
    assert r["engine_tokens"] == 8 * 4 and r["hf_tokens"] == 3 * 4  # no stop: all length
    assert r["greedy_identical_share"] == 1.0 and r["hf_subset"] == "prompts[::3] (3 of 8)"
    assert r["engine_tokens_per_s"] > 0 and r["hf_batched_tokens_per_s"] > 0 and r["hardware"]


def test_compiled_decode_steps_give_the_same_answers() -> None:
    """compile_decode fuses the decode step, compiled once for every cache shape (rows and
    length symbolic); a chosen SDPA backend leaves the answers as they are."""
    model = tiny_llama(400)
    prompts = _prompts(400, [12, 3, 30, 8, 300, 280])  # two cache lengths: 256 and 512
    settings = GenerationSettings("m", max_new_tokens=8)
    from torch._dynamo.utils import counters

    counters.clear()
    engine = StaticBatchEngine(
        model, settings, [5], 0, rows=4, compile_decode=True, decode_sdpa="math"
    )
    assert engine.generate(prompts) == _hf(model, prompts, 8, [5])
    assert [length for _rows, length in engine.stats.shapes] == [256, 512]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_flex_decode_attention_equals_the_masked_dense_one() -> None:
    """The flex decode attention (block mask from each row's live length) against SDPA over
    the whole masked cache, rows of very different lengths, two cache lengths, grouped and
    plain heads. Run eagerly here (the reference FlexAttention path; the compiled kernel is
    checked on a GPU: tests/test_regen_engine_gpu.py)."""
    from dflash_trainer.data.grouped_decode import flex_decode_attention

    g = torch.Generator().manual_seed(0)
    for length, kv_heads in ((256, 3), (512, 9)):
        pos = torch.tensor([0, 5, 127, 128, 200, length - 1])
        b = len(pos)
        q = torch.randn(b, 9, 1, 64, generator=g)
        k = torch.randn(b, kv_heads, length, 64, generator=g)
        v = torch.randn(b, kv_heads, length, 64, generator=g)
        mask = (torch.arange(length)[None, :] <= pos[:, None])[:, None, None, :]
        out, _ = flex_decode_attention(torch.nn.Module(), q, k, v, mask, scaling=0.125)
        rep = 9 // kv_heads
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, scale=0.125
        )
        torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_compiled_prefills_give_the_same_answers_fresh_and_continuing() -> None:
    """compile_prefill: prefills of new prompts and of conversations continuing after their
    history run compiled (symbolic rows and width): the chains still equal the uncompiled
    engine's, turn by turn."""
    from torch._dynamo.utils import counters

    model = _lively(tiny_llama(400))
    firsts = _prompts(400, [10, 60, 30, 45, 5])
    g = torch.Generator().manual_seed(3)
    extra = torch.randint(3, 400, (20,), generator=g).tolist()

    def run(compiled: bool) -> tuple[dict[int, list[list[int]]], Any]:
        got: dict[int, list[list[int]]] = {c: [] for c in range(len(firsts))}
        current = list(firsts)

        def follow(chain: int, ids: list[int]) -> tuple[list[int], int] | None:
            got[chain].append(list(ids))
            if len(got[chain]) == 2:
                return None
            current[chain] = current[chain] + ids + extra
            return current[chain], 0

        settings = GenerationSettings("m", max_new_tokens=12)
        engine = StaticBatchEngine(model, settings, [5], 0, rows=2, compile_prefill=compiled)
        engine.generate_chains([(p, 0) for p in firsts], follow)
        return got, engine.stats

    counters.clear()
    compiled, stats = run(True)
    assert stats.continued > 0 and counters["stats"]["unique_graphs"] >= 2
    assert not counters["graph_break"]
    assert compiled == run(False)[0]


def test_flex_decode_attention_needs_the_compiled_step() -> None:
    with pytest.raises(DFlashError, match="add --compile-decode"):
        StaticBatchEngine(tiny_llama(400), GenerationSettings("m"), [5], 0, decode_attention="flex")


def test_unknown_sdpa_backend_is_named() -> None:
    with pytest.raises(DFlashError, match="unknown SDPA backend 'fast'"):
        StaticBatchEngine(tiny_llama(400), GenerationSettings("m"), [5], 0, decode_sdpa="fast")


@pytest.mark.parametrize("reuse_prefix", [True, False])
def test_chains_queue_each_next_turn_at_once_across_cache_lengths(reuse_prefix: bool) -> None:
    """A conversation's next turn runs as soon as its answer is in (no rounds); turns that
    outgrow the cache length wait for the next one. Each chain equals HF turn by turn, with
    a next turn in the same cache length continuing in its row after the history it holds
    (only the new tokens prefilled) or prefilled whole in a fresh row."""
    model = _lively(tiny_llama(400))
    new, turns = 16, 3
    firsts = _prompts(400, [10, 200, 30, 225, 5])  # 225 + 16 fits 256; its next turn does not
    g = torch.Generator().manual_seed(3)
    extra = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (20, 40)]
    stops = _staggered_stops(model, firsts, new)

    def reference(prompt: list[int]) -> list[list[int]]:
        outs: list[list[int]] = []
        for t in range(turns):
            outs.append(_hf(model, [prompt], new, stops)[0])
            if t + 1 < turns:
                prompt = prompt + outs[-1] + extra[t]
        return outs

    got: dict[int, list[list[int]]] = {c: [] for c in range(len(firsts))}
    current = list(firsts)

    def follow(chain: int, ids: list[int]) -> tuple[list[int], int] | None:
        got[chain].append(list(ids))
        t = len(got[chain])
        if t == turns:
            return None
        current[chain] = current[chain] + ids + extra[t - 1]
        return current[chain], 0

    settings = GenerationSettings("m", max_new_tokens=new)
    engine = StaticBatchEngine(model, settings, stops, 0, rows=2, reuse_prefix=reuse_prefix)
    engine.generate_chains([(p, 0) for p in firsts], follow)
    assert got == {c: reference(p) for c, p in enumerate(firsts)}
    assert [length for _, length in engine.stats.shapes] == [256, 512]
    if reuse_prefix:  # every next turn that stayed in its cache length kept its history
        assert engine.stats.continued >= 4 and engine.stats.reused_tokens >= 4 * 10, engine.stats
    else:
        assert engine.stats.continued == 0 and engine.stats.reused_tokens == 0
    assert engine.calls == 1  # one call served every turn of every chain
