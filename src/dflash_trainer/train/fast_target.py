"""The fast step's target: fixed [R, L] chunks, each shape one CUDA graph (fast_step.py).

Shape legend: R = rows of a chunk, L = a row's length, T = pack length, F = tapped
feature width (n_tapped x H), H = target hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dflash_trainer.target.model import FrozenTarget
from dflash_trainer.train.fast_layout import FastShapes


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
        self, target: FrozenTarget, shapes: FastShapes, need_final: bool, graphs: bool
    ) -> None:
        self.target = target
        self.shapes = shapes
        self.graphs = graphs
        tc = target.model.config.get_text_config()
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
