"""The fast step's target: fixed [R, L] chunks, each shape one CUDA graph (fast_step.py).

Shape legend: R = rows of a chunk, L = a row's length, T = pack length, F = tapped
feature width (n_tapped x H), H = target hidden.

Attention over a chunk (`training.target_attention`), the same rule either way: a token sees
the tokens of its own document up to itself; padding sees only itself.
- dense: an [R, 1, L, L] additive mask through the target's own SDPA attention. Several
  documents share a row, so every row pays L x L pairs whatever its documents' lengths.
- flex: the whole pack as one sequence of T tokens (`fast_layout.pack_chunk`: one shape,
  one graph, one compile), attended by FlexAttention through a block mask that lists, for
  each 128-token query block, only the key blocks its documents reach. On the SmolLM2 set's
  packs that is about a third of the dense layout's pairs (`fast_layout.layout_cost`).
  Compiled on a GPU. On CPU FlexAttention runs its unfused reference path, which holds a
  T x T score matrix per head: small packs only (tests), refused beyond `CPU_FLEX_BYTES`.
(`chunk_intervals` also reads a chunk of several rows, laid end to end: documents never
cross a row, so the rule is the same.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from dflash_trainer.core.masks import Intervals, build_block_mask
from dflash_trainer.errors import DFlashError
from dflash_trainer.target.model import FrozenTarget, attending_with
from dflash_trainer.train.fast_layout import FastShapes

FLEX_ROWS = "dflash_flex_rows"
"""The attention implementation name the flex target forward registers with transformers."""
CPU_FLEX_BYTES = 2 * 2**30
"""The most score memory (fp32, all heads) the CPU reference path may hold for one layer."""


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def chunk_intervals(seg_RL: torch.Tensor) -> Intervals:
    """The chunk as one sequence: query q sees [start of its document, q]; padding sees q.
    (Document ids are unique and a document never crosses a row, so a change of id marks
    every document's start, row starts included.)"""
    seg = seg_RL.reshape(-1)
    idx = torch.arange(seg.numel(), device=seg.device)
    start = (seg != torch.roll(seg, 1)) | (seg < 0)
    lo = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), 0).values
    none = torch.zeros_like(idx, dtype=torch.int32)
    return Intervals(lo.int(), (idx + 1).int(), none, none, seg.numel())


def flex_rows_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An HF attention function: FlexAttention under the chunk's block mask."""
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled FlexAttention materialises the scores: the reference path, CPU tests only.
    fn = _compiled_flex() if query.device.type == "cuda" else flex_attention
    out = fn(
        query,
        key,
        value,
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2).contiguous(), None


class _Replay:
    """`fn()` run eagerly, or captured once as a CUDA graph (warm-up on a side stream first)."""

    def __init__(self, fn: Callable[[], None], graph: bool, pool: Any = None) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                fn()

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class TargetRunner:
    """The target over fixed [R, L] chunks, writing features (and final hidden) into the pack.

    Outputs are [T + 1, F] buffers: row T is where padding tokens are written and never
    read. Every chunk shape is one static input set and one CUDA graph (`graphs`).
    """

    def __init__(
        self,
        target: FrozenTarget,
        shapes: FastShapes,
        need_final: bool,
        graphs: bool,
        flex: bool = False,
    ) -> None:
        self.target = target
        self.shapes = shapes
        self.graphs = graphs
        self.flex = flex
        tc = target.model.config.get_text_config()
        if flex and target.device.type != "cuda":
            scores = 4 * tc.num_attention_heads * shapes.ctx_len**2
            if scores > CPU_FLEX_BYTES:
                raise DFlashError(
                    f"training.target_attention=flex on {target.device.type}: FlexAttention's "
                    f"unfused path would hold {scores / 2**30:.1f} GB of scores per layer for a "
                    f"{shapes.ctx_len}-token pack; use training.target_attention=dense off the GPU"
                )
        dev, dtype = target.device, target.model.dtype
        t = shapes.ctx_len + 1
        self.feat = torch.zeros(t, tc.hidden_size * len(target.layer_ids), dtype=dtype, device=dev)
        self.final = torch.zeros(t, tc.hidden_size, dtype=dtype, device=dev) if need_final else None
        self.static: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], _Replay]] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.capture_failed: str | None = None

    def _mask(self, seg_RL: torch.Tensor) -> torch.Tensor:
        """[R, 1, L, L]: same document and not in the future; padding sees itself only."""
        n = seg_RL.shape[1]
        ar = torch.arange(n, device=seg_RL.device)
        causal = ar[None, :] <= ar[:, None]
        same = (seg_RL[:, :, None] == seg_RL[:, None, :]) & (seg_RL[:, None, :] >= 0)
        # A padding query with no key at all would give NaN, and NaN values poison real
        # queries in later layers (0 * NaN): let it see itself.
        ok = (same & causal[None]) | torch.eye(n, dtype=torch.bool, device=seg_RL.device)[None]
        # Additive, in the model's dtype, built once per forward: SDPA would turn a bool
        # mask into this in every layer (eager attention needs it additive anyway).
        dtype = self.target.model.dtype
        zero = torch.zeros((), dtype=dtype, device=ok.device)
        return torch.where(ok, zero, torch.finfo(dtype).min)[:, None]

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, dst: torch.Tensor):
        tg = self.target
        with tg.taps() as cap:
            if self.flex:
                with attending_with(tg.model, FLEX_ROWS, flex_rows_attention):
                    out = tg.decoder(
                        input_ids=ids.reshape(1, -1),
                        attention_mask=build_block_mask(chunk_intervals(seg)),
                        position_ids=pos.reshape(1, -1),
                        use_cache=False,
                    )
            else:
                out = tg.decoder(
                    input_ids=ids, attention_mask=self._mask(seg), position_ids=pos, use_cache=False
                )
            feats = tg.features_of(cap)
        flat = dst.reshape(-1)
        self.feat.index_copy_(0, flat, feats.reshape(flat.numel(), -1))
        if self.final is not None:
            self.final.index_copy_(0, flat, out.last_hidden_state.reshape(flat.numel(), -1))

    def _replay_for(self, key: tuple[int, int], host: tuple[torch.Tensor, ...]) -> _Replay:
        dev = self.feat.device
        bufs = tuple(torch.empty(key, dtype=torch.long, device=dev) for _ in range(4))
        for b, h in zip(bufs, host):
            b.copy_(h)
        fn = self._static_fn(bufs)
        try:
            replay = _Replay(fn, self.graphs, self.pool)
        except RuntimeError as e:  # a target op that cannot be captured: run it eagerly
            self.capture_failed = f"{type(e).__name__}: {e}"
            self.graphs = False
            replay = _Replay(fn, False)
        self.static[key] = (bufs, replay)
        return replay

    def _static_fn(self, bufs: tuple[torch.Tensor, ...]) -> Callable[[], None]:
        return lambda: self._forward(*bufs)

    def run(self, chunks: list[Any]) -> None:
        """All chunks of one micro-step; the previous step's outputs are overwritten."""
        self.feat.zero_()  # pack padding must read zeros (finite), as the standard pack
        for ch in chunks:
            host = (ch.ids_RL, ch.pos_RL, ch.seg_RL, ch.dst_RL)
            entry = self.static.get(ch.shape)
            if entry is None:
                replay = self._replay_for(ch.shape, host)
            else:
                bufs, replay = entry
                for b, h in zip(bufs, host):
                    b.copy_(h, non_blocking=True)
            replay()
