"""The state a `StaticBatchEngine` (data/engine.py) keeps: cache buckets, built shapes, the
prompts of a call, statistics."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trainer.eval.static_decode import _Replay, _SlotCache


def cache_length(tokens: int) -> int:
    """The cache bucket for sequences of `tokens` positions: a power of two, at least 256."""
    return max(256, 1 << math.ceil(math.log2(max(tokens, 1))))


def kv_bytes_per_position(model: Any) -> int:
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv * dim * model.dtype.itemsize


@dataclass
class EngineStats:
    decode_steps: int = 0
    row_steps: int = 0
    """Rows stepped in all (rows x steps)."""
    row_steps_busy: int = 0
    """Of those, rows that held a live prompt: the utilisation is their share."""
    prefills: int = 0
    builds: int = 0
    shapes: list[tuple[int, int]] = field(default_factory=list)
    """(rows, cache length) of every build."""
    build_s: float = 0.0
    """Seconds building shapes: caches, warm-up step, graph capture."""
    prefill_s: float = 0.0
    """Seconds in prefill forwards (to their first tokens on the host)."""
    decode_s: float = 0.0
    """Seconds in decode steps (replay until the tokens are on the host)."""
    host_s: float = 0.0
    """Seconds of per-step bookkeeping on the host (appending tokens, stop checks)."""
    continued: int = 0
    """Chain turns prefilled in their conversation's own row, after its cached history."""
    reused_tokens: int = 0
    """History tokens those turns did not prefill again."""


Follow = Callable[[int, list[int]], "tuple[list[int], int] | None"]


@dataclass
class Work:
    """The prompts of one engine call; grows as chains add their next prompts."""

    prompts: list[list[int]]
    keys: list[int]
    outs: list[list[int]]
    on_done: Callable[[int], int | None]

    def cached(self, i: int) -> list[int]:
        """The tokens prompt i's row holds once it is answered: the prompt and every new
        token but the last (a token is written to the cache when it is fed, one step later)."""
        return self.prompts[i] + self.outs[i][:-1]


@dataclass
class Shape:
    """One built (rows, cache length): its KV cache, static inputs and decode replay."""

    rows: int
    length: int
    cache: _SlotCache
    ids: torch.Tensor
    pos: torch.Tensor
    keys: torch.Tensor
    row_ix: torch.Tensor
    cols: torch.Tensor
    replay: _Replay | None = None
    capped: bool = False
    """Fewer rows than asked for, for lack of memory: do not rebuild to grow it."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Rows:
    """Where each cache row of a running group is: decoding (`live`: row -> prompt), free,
    or about to continue its conversation (`cont`: row, next prompt, tokens it holds)."""

    queue: deque[int]
    free: list[int]
    live: dict[int, int] = field(default_factory=dict)
    cont: list[tuple[int, int, int]] = field(default_factory=list)
