"""The state a `StaticBatchEngine` (data/engine.py) keeps: cache buckets, built shapes, the
prompts of a call, the decode step in flight, statistics; and its prefill inputs."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trainer.errors import DFlashError
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
    """Seconds waiting for decode steps' tokens (GPU time the host work did not cover)."""
    host_s: float = 0.0
    """Seconds of per-step bookkeeping on the host (appending tokens, stop checks); on a GPU
    it runs while the next step does."""
    continued: int = 0
    """Chain turns prefilled in their conversation's own row, after its cached history."""
    reused_tokens: int = 0
    """History tokens those turns did not prefill again."""
    carries: int = 0
    """Times a cache length's busy rows moved into the next length instead of draining."""
    carried_rows: int = 0
    """Rows so moved, each with its cache (data/engine_schedule.py)."""


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


def flex_decode(decode_attention: str, compile_decode: bool) -> bool:
    """Whether the decode step attends through FlexAttention (`decode_attention` checked)."""
    if decode_attention not in ("sdpa", "flex"):
        raise DFlashError(f"unknown decode attention {decode_attention!r}; use sdpa or flex")
    if decode_attention == "flex" and not compile_decode:
        raise DFlashError(
            "decode attention flex runs only in the compiled decode step: add --compile-decode"
        )
    return decode_attention == "flex"


def prefill_inputs(
    prompts: list[list[int]], starts: list[int] | None, pad_id: int, align: int, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, real) [k, W] of a prefill, left-padded: prompt i from token starts[i]
    (0 without `starts`), at its own positions."""
    k = len(prompts)
    begin = starts or [0] * k
    width = max(len(p) - c for p, c in zip(prompts, begin))
    # Widths rounded up to a few values: every new prefill shape costs kernel selection
    # (and attention plans) on a GPU; the extra columns are padding like any other.
    width = min(-(-width // align) * align, length)
    ids = torch.full((k, width), pad_id, dtype=torch.long)
    pos = torch.empty((k, width), dtype=torch.long)
    real = torch.zeros((k, width), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, begin)):
        n, end = len(p) - c, len(p)
        ids[i, width - n :] = torch.tensor(p[c:], dtype=torch.long)
        pos[i, width - n :] = torch.arange(c, end)
        # Padding gets slots after the prompt (decode overwrites them before reading);
        # past the cache, the last slot, which no live token of this row ever takes.
        pos[i, : width - n] = torch.arange(end, end + width - n).clamp(max=length - 1)
        real[i, width - n :] = True
    return ids, pos, real


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
    no_carry: bool = False
    """The next cache length has no room beside this one: its rows drain here."""


Flight = Callable[[], list[int]]
"""A decode step in flight: reads its tokens (waiting for the step when it has not ended)."""


class StepTokens:
    """A queued decode step's tokens, read on the host once the step is done.

    Why: reading a step's tokens waits for the GPU, and the host work after it (each row's
    stop checks, the loop stop's look) left the GPU idle. The engine queues the next step
    before reading the last one; on a GPU the graph writes every step into the same output
    buffer, so each step's tokens are first copied behind it into one of two pinned host
    buffers (the one read last is the one written next)."""

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor] = []
        self.flip = 0

    def queue(self, out: torch.Tensor) -> Flight:
        if out.device.type != "cuda":
            tokens = out.tolist()
            return lambda: tokens
        if not self.bufs or self.bufs[0].shape != out.shape:
            self.bufs = [torch.empty(out.shape, dtype=out.dtype, pin_memory=True) for _ in "ab"]
        buf = self.bufs[self.flip]
        self.flip ^= 1
        buf.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def read() -> list[int]:
            done.synchronize()
            return list(buf.tolist())

        return read
