"""Decode-step attention that reads each key/value head once (grouped-query targets).

Why: a one-token decode step over a long fixed cache is bound by reading the cache. With an
explicit mask (the engine needs one: every row has its own length), older HF `sdpa` attention
cannot use SDPA's grouped-query mode and copies every key/value head `groups` times
(`repeat_kv`) before attending: SmolLM2-135M has 9 query heads over 3 key/value heads, so a
256-row step over a 1,024-slot cache writes and reads 3x the cache, about 36 GB, where
the attention needs 6 GB. Here the `groups` query heads of a one-token step become `groups`
query rows of their key/value head ([B, H, 1, D] -> [B, Hkv, G, D]), so SDPA attends to
the cache as stored; the [B, 1, 1, L] row mask broadcasts over both. Steps with more than one
query token (the prefill) go to HF's own `sdpa` attention unchanged.

Query head h belongs to key/value head h // G, the order `repeat_kv` expands in, so the
result is the same attention, not an approximation (tests/test_regen_engine.py checks the
engine against HF `generate` token for token).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

NAME = "dflash_grouped_decode"

_SDPA = {
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "math": "MATH",
}


def sdpa_backends(names: str | None) -> list[Any] | None:
    """`"efficient,math"` -> the SDPA backends allowed, in that order; None: torch's choice.

    Why a choice: at the engine's decode shapes (3 query rows per key/value head, a long
    masked cache) the backend torch prefers is not the fastest
    (benchmarks/decode_attention_speed.py)."""
    if not names:
        return None
    from torch.nn.attention import SDPBackend

    out = []
    for name in names.split(","):
        key = _SDPA.get(name.strip())
        if key is None:
            from dflash_trainer.errors import DFlashError

            raise DFlashError(f"unknown SDPA backend {name!r}; use {', '.join(_SDPA)}")
        out.append(getattr(SDPBackend, key))
    return out


def sdpa_scope(backends: list[Any] | None) -> AbstractContextManager[Any]:
    """Attention inside runs on `backends` (traceable by torch.compile); no-op for None."""
    if backends is None:
        return nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)


def grouped_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface signature: query [B, H, S, D], key/value [B, Hkv, L, D]."""
    b, heads, s, _d = query.shape
    kv_heads = key.shape[1]
    if s != 1 or kv_heads == heads:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed = query.reshape(b, kv_heads, heads // kv_heads, query.shape[-1])
    out = F.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(b, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


FLEX_NAME = "dflash_flex_decode"
_KV_BLOCK = 128


def flex_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A one-token decode step that reads each row's own length of the cache, not all of it.

    Why: the engine's cache buckets are powers of two covering prompt + max_new_tokens, and a
    row's live length is on average under half its bucket, but a masked dense attention reads
    the whole bucket. FlexAttention skips key blocks a block mask marks empty; the mask is
    built inside the step from the engine's row mask (key slot <= position, a prefix), so the
    step keeps its static shapes and stays one CUDA graph. Only compiled (inductor's decoding
    kernel): uncompiled FlexAttention is a slow reference path. Prefill goes to `sdpa`."""
    b, heads, s, _d = query.shape
    if s != 1 or attention_mask is None or attention_mask.dtype != torch.bool:
        return grouped_decode_attention(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    length = key.shape[2]
    lens = attention_mask.reshape(b, length).sum(-1)  # the row's live prefix: slots <= pos
    blocks = ((lens + _KV_BLOCK - 1) // _KV_BLOCK).to(torch.int32).view(b, 1, 1)
    order = torch.arange(length // _KV_BLOCK, dtype=torch.int32, device=query.device)
    order = order.view(1, 1, 1, -1).expand(b, 1, 1, -1)

    def live(bi: Any, _h: Any, _q: Any, kv: Any) -> Any:
        return kv < lens[bi]

    mask = BlockMask.from_kv_blocks(
        blocks, order, BLOCK_SIZE=_KV_BLOCK, mask_mod=live, seq_lengths=(1, length)
    )
    out = flex_attention(
        query, key, value, block_mask=mask, scale=scaling, enable_gqa=key.shape[1] != heads
    )
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def grouped_decode(model: Any, flex: bool = False) -> Iterator[bool]:
    """While open, an `sdpa` grouped-query `model` attends with `grouped_decode_attention`
    (with `flex`, any `sdpa` model with `flex_decode_attention`); yields whether it does
    (other targets are left as they are)."""
    cfg = model.config
    text = cfg.get_text_config()
    impl = getattr(cfg, "_attn_implementation", None)
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if impl != "sdpa" or heads % kv or (kv == heads and not flex):
        yield False
        return
    from dflash_trainer.target.model import attending_with

    name, fn = (FLEX_NAME, flex_decode_attention) if flex else (NAME, grouped_decode_attention)
    with attending_with(model, name, fn):
        yield True
