"""data/grouped_decode.py: the packed one-token attention is HF's attention, not a variant."""

from __future__ import annotations

import pytest
import torch
from test_data_support import tiny_llama
from test_speculative import tiny_qwen3
from transformers import DynamicCache

from dflash_trainer.data.grouped_decode import NAME, grouped_decode, grouped_decode_attention
from dflash_trainer.eval.target_runner import cache_kwarg

pytestmark = pytest.mark.usefixtures("one_thread")


def _repeat_kv_reference(q, k, v, mask, scale):  # type: ignore[no-untyped-def]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def test_one_token_attention_equals_repeated_heads_with_row_masks() -> None:
    g = torch.Generator().manual_seed(0)
    b, heads, kv, length, d = 5, 9, 3, 40, 16
    q = torch.randn(b, heads, 1, d, generator=g)
    k, v = torch.randn(b, kv, length, d, generator=g), torch.randn(b, kv, length, d, generator=g)
    lengths = torch.tensor([1, 7, 40, 13, 22])
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :]
    module = torch.nn.Module()
    out, _ = grouped_decode_attention(module, q, k, v, mask, scaling=0.25)
    ref = _repeat_kv_reference(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_a_decode_step_of_the_model_is_unchanged_and_the_switch_is_undone() -> None:
    model = tiny_llama(300)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))

    def step() -> torch.Tensor:
        cache = {cache_kwarg(model): DynamicCache(config=model.config)}
        model(input_ids=ids[:, :-1], use_cache=True, **cache)
        mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
        mask[0, ..., :3] = False  # a row that ignores its first slots: masks must reach SDPA
        pos = torch.full((2, 1), 11)
        out = model(input_ids=ids[:, -1:], position_ids=pos, attention_mask=mask, **cache)
        return out.logits

    with torch.no_grad():
        ref = step()
        with grouped_decode(model) as active:
            assert active and model.config._attn_implementation == NAME
            got = step()
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_targets_it_does_not_serve_are_left_alone() -> None:
    eager = tiny_qwen3(seed=1, attn="eager")
    with grouped_decode(eager) as active:
        assert not active and eager.config._attn_implementation == "eager"
