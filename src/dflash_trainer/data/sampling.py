"""Token choice for batched generation: greedy, or a keyed draw that depends only on the
prompt's key and the step, never on which rows share the batch (data/engine.py).

Keys come from `item_key` (a stable hash of the job's seed and the item), so a resumed job
draws exactly what an uninterrupted one would have.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (int64 arithmetic; only the low 32 bits are kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def keyed_uniform(keys_B: torch.Tensor, steps_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), a pure function of (key, step, token id): the same on CPU and
    GPU, eager or replayed, whatever else is in the batch."""
    cols = torch.arange(vocab, device=keys_B.device, dtype=torch.long)
    row = _fmix((_fmix(keys_B & _M32) ^ (steps_B * 0x9E3779B1)) & _M32)
    h = _fmix((row[:, None] ^ (cols[None, :] * 0x27D4EB2F)) & _M32)
    return (h.to(torch.float64) + 0.5).div_(2.0**32).to(torch.float32)


def pick_tokens(
    logits_BV: torch.Tensor,
    temperature: float,
    top_p: float,
    keys_B: torch.Tensor,
    steps_B: torch.Tensor,
) -> torch.Tensor:
    """Next token per row: argmax at temperature 0, else a keyed draw from the tempered
    distribution cut to its top_p nucleus (an exponential race: argmax of p / Exp(1) noise)."""
    if temperature <= 0:
        return logits_BV.argmax(-1)
    probs = torch.softmax(logits_BV / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass before it is below top_p (the first is always kept).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    noise = -torch.log(keyed_uniform(keys_B, steps_B, probs.shape[-1]))
    return (probs / noise).argmax(-1)


def item_key(*parts: int | str) -> int:
    """A 31-bit key from ints and strings (stable across runs, unlike hash())."""
    import zlib

    return zlib.crc32("\x1f".join(map(str, parts)).encode()) & 0x7FFFFFFF
