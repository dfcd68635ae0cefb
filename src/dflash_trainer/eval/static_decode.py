"""Static-shape decoding for the speculative loop: fixed-size caches, CUDA graphs on a GPU.

Why: a small target decoded by HF's eager code is launch-bound. SmolLM2-135M takes about
30 ms per forward on an H200, most of it Python and a few hundred kernel launches. So the
target-only baseline and the speculative loop both measure the host rather than the GPU,
and a few hundred evaluated responses outlast a device slot. A captured CUDA graph replays
a whole forward with one launch.

Each forward shape is fixed (a capacity of L positions), so nothing is ever cropped and the
output stays exactly the dynamic loop's:
- Target (`StaticTargetRunner`): per layer, a K/V buffer of L positions, written at the
  positions of the fed tokens. A query at position p attends keys 0..p, through a 4D mask
  computed from the positions inside the graph. Rejected drafts left beyond the committed
  prefix are therefore invisible, and the next verify overwrites them. Rewinding only sets
  the length.
- Drafter (`StaticDFlashDrafter`): per layer, the context K/V of L positions. Each step first
  writes the K/V of all B feature rows of the last verify at their positions (committed and
  rejected alike), then drafts the block. The block attends context positions below the
  anchor only, so the rejected rows are masked out and the next step overwrites them. One
  shape per step, so one graph.

Graphs read and write fixed addresses: inputs are copied into static buffers before a
replay, and outputs (logits, features, drafts) are valid until the next replay of the same
graph, which is when the loop no longer needs them.

With `compile_drafter` (`dflash eval --compile-drafter`) the drafter step is also compiled
(torch.compile, static shapes, one whole graph) before it is captured: inside a CUDA graph
launches cost nothing, but each of a DFlash2 step's ~250 tiny kernels still costs GPU time,
and fusing them is what is left to gain. The drafts are the uncompiled step's
(tests/test_compiled_drafter.py).

Supported: attention-only targets without sliding windows, with sdpa or eager attention on
one device (`static_support` says why a target is not). The others use the dynamic path,
target_runner.DynamicTargetRunner, which crops its cache and re-feeds recurrent layers.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dflash_trainer.core.drafter import sdpa_attention
from dflash_trainer.core.masks import inference_mask
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.compiled_step import compiled_step
from dflash_trainer.eval.drafting import Proposal, draft_tokens
from dflash_trainer.eval.speculative import DFlashBlockDrafter
from dflash_trainer.eval.target_runner import cache_kwarg, target_forward
from dflash_trainer.target.model import FrozenTarget

DECODE_MODES = ("auto", "graphs", "static", "eager")
"""auto: graphs on CUDA when the target allows, else eager. graphs: static shapes replayed as
CUDA graphs. static: the same static shapes run eagerly (CPU, or to check graphs). eager: HF
DynamicCache, cropped (every target)."""


def static_support(model: Any) -> str | None:
    """None when the static path can run this target, else the reason it cannot."""
    cfg = model.config.get_text_config()
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer types {sorted(types)}: only full-attention layers have a static cache here"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return f"sliding_window={cfg.sliding_window}: sliding-window layers have no static path"
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        return f"attn_implementation={impl}: the static path passes a 4D mask (sdpa or eager)"
    if len({p.device for p in model.parameters()}) > 1:
        return "the target is spread over several devices"
    return None


def resolve_decode(mode: str, target: FrozenTarget) -> str:
    """The decode mode to use for `mode` (one of DECODE_MODES) on this target."""
    if mode not in DECODE_MODES:
        raise DFlashError(f"decode mode {mode!r}: choose one of {', '.join(DECODE_MODES)}")
    if mode == "eager":
        return mode
    why = static_support(target.model)
    cuda = target.device.type == "cuda"
    if mode == "auto":
        return "graphs" if cuda and why is None else "eager"
    if why is not None:
        raise DFlashError(f"--decode {mode}: {why}; use --decode eager")
    if mode == "graphs" and not cuda:
        raise DFlashError("--decode graphs needs a CUDA device; use --decode static or eager")
    return mode


def compile_drafter_error(mode: str, target: FrozenTarget | None = None) -> DFlashError:
    """The error for --compile-drafter when `mode` (as asked) decodes eagerly."""
    how = f"--decode {mode}"
    if mode == "auto" and target is not None:  # auto picks eager for one of two reasons
        how += f" picks eager here ({static_support(target.model) or 'no CUDA device'}) and"
    return DFlashError(
        f"--compile-drafter needs --decode static or graphs: {how} decodes with HF's dynamic "
        "cache, which has no fixed-shape drafter step to compile"
    )


class _Replay:
    """`fn()` run eagerly each call, or captured once as a CUDA graph and replayed."""

    def __init__(self, fn: Callable[[], Any], graph: bool) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Any = None
        if graph:
            # Warm-up on a side stream (cuBLAS handles, workspace, lazy buffers) before the
            # capture, as torch.cuda.graphs requires; fn's writes land where the caller said.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()

    def __call__(self) -> Any:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


class _SlotCache:
    """What HF attention layers need of a cache: `update` writes the new K/V at `positions`
    of a [batch, Hkv, L, D] buffer per layer and returns the whole buffer (the mask hides the
    positions not yet written or no longer committed).

    Batch 1 (the speculative loop): `positions` [S] is where the S fed tokens go.
    Several rows (batched regeneration, data/engine.py): `rows` [R] names the cache rows fed
    and `positions` [R, S] where each row's tokens go, so every row keeps its own length. With
    `fresh` (the prefill of new prompts) the rows attend only to what they are fed, so update
    returns the fed K/V themselves rather than the buffer: nothing before them is theirs. With
    `subset` (a few rows continuing after the history they hold) it returns those rows' part
    of the buffer.
    """

    def __init__(self, capacity: int, batch: int | None = None) -> None:
        self.capacity = capacity
        self.batch = batch
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.positions: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.fresh = False
        self.subset = False

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: Any,
        **__: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.positions is not None
        if layer_idx not in self.keys:
            b, h, _s, d = key_states.shape
            b = self.batch or b
            self.keys[layer_idx] = key_states.new_zeros(b, h, self.capacity, d)
            self.values[layer_idx] = value_states.new_zeros(
                b, h, self.capacity, value_states.shape[-1]
            )
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.rows is None:
            keys.index_copy_(2, self.positions, key_states)
            values.index_copy_(2, self.positions, value_states)
            return keys, values
        # Advanced indices around a slice: the indexed view is [R, S, Hkv, D].
        where = (self.rows[:, None], slice(None), self.positions)
        keys[where] = key_states.transpose(1, 2).to(keys.dtype)
        values[where] = value_states.transpose(1, 2).to(values.dtype)
        if self.fresh:
            return key_states, value_states
        if self.subset:  # a few rows continue after their cached history: theirs only
            return keys[self.rows], values[self.rows]
        return keys, values


def capacity_for(tokens: int, minimum: int = 1024) -> int:
    """Cache capacity for sequences of up to `tokens` positions: room to spare, rounded."""
    return max(minimum, 256 * math.ceil(tokens / 256))


class StaticTargetRunner:
    """`target_runner.TargetRunner` over a `_SlotCache`; the (S, taps) shapes in `shapes` run
    from static buffers (as CUDA graphs with `graphs`), any other forward (the prefill) runs
    eagerly against the same cache."""

    def __init__(
        self,
        target: FrozenTarget,
        capacity: int,
        shapes: Sequence[tuple[int, bool]],
        graphs: bool,
    ) -> None:
        why = static_support(target.model)
        if why is not None:
            raise DFlashError(f"static decoding: {why}")
        self.target = target
        self.capacity = capacity
        self.cache = _SlotCache(capacity)
        self.cache_kwarg = cache_kwarg(target.model)
        dev = target.device
        self._cols = torch.arange(capacity, device=dev)
        self._bool_mask = getattr(target.model.config, "_attn_implementation", "sdpa") != "eager"
        self.length = 0
        self.forwards = 0
        # One eager forward allocates every layer's buffer before any capture; it writes
        # position 0, which every prefill overwrites.
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        self._run(zero[None], zero, taps=False, keep=1)
        self._shapes: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor, _Replay]] = {}
        for s, taps in dict.fromkeys(shapes):
            if s > capacity:
                raise DFlashError(f"a {s}-token forward does not fit a {capacity}-position cache")
            ids = torch.zeros(1, s, dtype=torch.long, device=dev)
            pos = torch.arange(s, device=dev)  # warm-up and capture write positions 0..s-1
            replay = _Replay(functools.partial(self._run, ids, pos, taps, 0), graphs)
            self._shapes[(s, taps)] = (ids, pos, replay)

    def _mask(self, pos_S: torch.Tensor) -> torch.Tensor:
        ok = self._cols[None, :] <= pos_S[:, None]  # [S, L]: key position <= query position
        if self._bool_mask:
            return ok[None, None]
        dtype = self.target.model.dtype
        zero = torch.zeros((), dtype=dtype, device=ok.device)
        return torch.where(ok, zero, torch.finfo(dtype).min)[None, None]

    def _run(
        self, ids_1S: torch.Tensor, pos_S: torch.Tensor, taps: bool, keep: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.cache.positions = pos_S
        kwargs: dict[str, Any] = {
            "input_ids": ids_1S,
            "position_ids": pos_S[None],
            "attention_mask": self._mask(pos_S),
            self.cache_kwarg: self.cache,
            "use_cache": True,
        }
        if keep:
            kwargs["logits_to_keep"] = keep
        return target_forward(self.target, kwargs, taps)

    # --- TargetRunner

    def begin(self) -> None:
        self.length = 0
        self.forwards = 0

    def forward(
        self, ids_S: torch.Tensor, taps: bool, last_logits_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        start, s = self.length, ids_S.numel()
        if start + s > self.capacity:
            raise DFlashError(
                f"static decoding: {start + s} positions exceed the cache's {self.capacity}"
            )
        static = None if last_logits_only else self._shapes.get((s, taps))
        if static is None:
            pos = torch.arange(start, start + s, device=ids_S.device)
            out = self._run(ids_S.view(1, s), pos, taps, 1 if last_logits_only else 0)
        else:
            ids, pos, replay = static
            ids.copy_(ids_S.view(1, s))
            torch.add(self._cols[:s], start, out=pos)
            out = replay()
        self.length += s
        self.forwards += 1
        return out

    def after_prefill(self) -> None:
        pass

    def snapshot(self, block: int) -> None:
        return None

    def rewind(self, block_S: torch.Tensor, kept: int, snapshot: Any) -> None:
        self.length -= block_S.numel() - kept


class StaticDFlashDrafter(DFlashBlockDrafter):
    """`DFlashBlockDrafter` with a fixed-size context cache: one step (write the last verify's
    feature rows, draft the block) is one static shape, replayed as a CUDA graph with
    `graphs`. Drafts equal the dynamic drafter's (tests/test_static_decode.py).

    `compile_drafter`: each step is torch.compile'd (eval/compiled_step.py) and run once when it is
    built, so the compile lands outside any timed decode and before a capture, which then
    records the compiled kernels. A compile that fails leaves the step uncompiled, with one
    warning, and `compile_drafter` False."""

    def __init__(
        self,
        model: nn.Module,
        target: FrozenTarget,
        capacity: int,
        block_size: int | None = None,
        graphs: bool = False,
        draft_sampling: str = "auto",
        temperature: float = 0.0,
        compile_drafter: bool = False,
        draft_temperature_scale: float = 1.0,
    ) -> None:
        super().__init__(model, target, block_size, draft_sampling, draft_temperature_scale)
        self.compile_drafter = compile_drafter
        spec = self.model.spec
        dev, dt, b = target.device, self.dtype, self.block_size
        self.capacity = capacity
        shape = (capacity, spec.num_key_value_heads, spec.head_dim)
        self.keys = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(spec.num_layers)]
        self.values = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(spec.num_layers)]
        self.feats = torch.zeros(b, spec.num_context_features, device=dev, dtype=dt)
        self.write_at = torch.zeros((), dtype=torch.long, device=dev)
        self.anchor_pos = torch.zeros((), dtype=torch.long, device=dev)
        self.anchor_id = torch.zeros(1, dtype=torch.long, device=dev)
        self._slots = torch.arange(b, device=dev)
        self._uniforms = torch.zeros(b - 1, device=dev)
        self._graphs = graphs
        self._steps: dict[tuple[bool, float], _Replay] = {}
        # Captured now, outside any timed decode: the step of the evaluation's temperature.
        self.set_sampling(temperature, None)
        self._replay()

    def _draft(self, sampled: bool) -> tuple[torch.Tensor, Any, Any]:
        m = self.model
        pos = self.write_at + self._slots
        for keys, values, (k, v) in zip(
            self.keys, self.values, m.context_kv(m.project_context(self.feats), pos)
        ):
            keys.index_copy_(0, pos, k.to(keys.dtype))
            values.index_copy_(0, pos, v.to(values.dtype))
        anchor_emb = self.target.embed(self.anchor_id).to(self.dtype)
        block = torch.cat([anchor_emb, self.mask_emb_1H.expand(self.block_size - 1, -1)])
        ctx = list(zip(self.keys, self.values))
        spec = m.spec
        masks = {
            kind: inference_mask(
                self.anchor_pos,
                self.block_size,
                spec.sliding_window if kind == "sliding_attention" else None,
                self.anchor_pos.device,
                columns=self.capacity,
            )
            for kind in set(spec.layer_types)
        }
        hidden = m.run_layers(
            block, ctx, self.anchor_pos + self._slots, masks, sdpa_attention, self.block_size
        )
        return draft_tokens(
            hidden[1:],
            self.target.lm_head_weight,
            self.anchor_id,
            self.selector,
            self.top_k,
            self.temperature,
            self._uniforms if sampled else None,
        )

    # no_grad: the buffers hold values, never an autograd graph (the loop runs with grad on
    # in tests), and a compiled step's guards would see them turn requires_grad and recompile.
    @torch.no_grad()
    def start(self, prompt_ids_P: torch.Tensor, features_PF: torch.Tensor | None) -> None:
        assert features_PF is not None, "DFlash drafting needs the target's tapped features"
        n = features_PF.shape[0]
        if n + self.block_size > self.capacity:
            raise DFlashError(f"static decoding: a {n}-token prompt exceeds the drafter cache")
        pos = torch.arange(n, device=features_PF.device)
        kv = self.model.context_kv(self.model.project_context(features_PF.to(self.dtype)), pos)
        for keys, values, (k, v) in zip(self.keys, self.values, kv):
            keys[:n] = k
            values[:n] = v

    @torch.no_grad()
    def __call__(
        self, ids_N: torch.Tensor, new_features_SF: torch.Tensor | None
    ) -> torch.Tensor | Proposal:
        a = ids_N.numel() - 1  # the anchor's position; the context holds 0..a-1
        if a + self.block_size > self.capacity:
            raise DFlashError(f"static decoding: position {a} exceeds the drafter cache")
        if new_features_SF is None:  # first step: start() wrote the prompt's features
            self.write_at.fill_(a)  # stale rows land at >= a: masked, overwritten later
        else:
            s = new_features_SF.shape[0]
            self.feats[:s].copy_(new_features_SF)
            self.write_at.fill_(a - s)
        self.anchor_pos.fill_(a)
        self.anchor_id.copy_(ids_N[-1:])
        if self.samples:
            self._uniforms.copy_(
                torch.rand(self.block_size - 1, device=ids_N.device, generator=self.generator)
            )
        tokens, q, ids = self._replay()()
        return self.proposal(tokens, q, ids)

    def _replay(self) -> _Replay:
        """The step for the current draft mode; a graph bakes in the temperature it was
        captured with, so there is one per mode and temperature (and so is a compiled step:
        the temperature is a constant of its code)."""
        key = (self.samples, self.temperature if self.samples else 0.0)
        replay = self._steps.get(key)
        if replay is None:
            step: Callable[[], Any] = functools.partial(self._draft, key[0])
            if self.compile_drafter:
                step, self.compile_drafter = compiled_step(step)
            replay = _Replay(step, self._graphs)
            self._steps[key] = replay
        return replay


class DecodeEngines:
    """The target runner and drafter of one evaluation in a decode mode, rebuilt with a larger
    capacity when a request needs it (static modes; eager builds per call). `compile_drafter`
    compiles the drafter's step (`StaticDFlashDrafter`), a DFlashError with eager decoding."""

    def __init__(
        self,
        target: FrozenTarget,
        mode: str,
        drafter: nn.Module | None,
        block_size: int,
        taps: bool,
        draft_sampling: str = "auto",
        temperature: float = 0.0,
        compile_drafter: bool = False,
        draft_temperature_scale: float = 1.0,
    ) -> None:
        self.target = target
        self.draft_temperature_scale = draft_temperature_scale
        self.mode = resolve_decode(mode, target)
        if compile_drafter and self.mode == "eager":
            raise compile_drafter_error(mode, target)
        self.compile_drafter = compile_drafter and drafter is not None
        """Whether the drafter step runs compiled (False again after a failed compile)."""
        self.draft_sampling = draft_sampling
        self.temperature = temperature
        self.drafter_module = drafter
        self.block_size = block_size
        self.taps = taps
        self.capacity = 0
        self.runner: StaticTargetRunner | None = None
        self.drafter: StaticDFlashDrafter | None = None

    def ensure(self, tokens: int) -> None:
        """Room for `tokens` positions (prompt + new tokens + a block of slack)."""
        if self.mode == "eager" or tokens <= self.capacity:
            return
        cap = capacity_for(tokens)
        graphs = self.mode == "graphs"
        shapes = [(1, False)] + ([(self.block_size, self.taps)] if self.block_size > 1 else [])
        # Free the old buffers (and graph pools) before allocating the new ones.
        self.runner = self.drafter = None
        try:
            self.runner = StaticTargetRunner(self.target, cap, shapes, graphs)
            if self.drafter_module is not None:
                self.drafter = StaticDFlashDrafter(
                    self.drafter_module,
                    self.target,
                    cap,
                    self.block_size,
                    graphs,
                    self.draft_sampling,
                    self.temperature,
                    self.compile_drafter,
                    self.draft_temperature_scale,
                )
                # A failed compile warned once: a rebuild at a larger capacity does not retry.
                self.compile_drafter = self.drafter.compile_drafter
        except DFlashError:
            raise
        except Exception as e:  # a capture that fails names the op; eager still works
            if not graphs:
                raise
            print(
                f"dflash: CUDA graph capture failed ({type(e).__name__}: {e}); "
                "continuing with --decode static",
                file=sys.stderr,
            )
            self.mode = "static"
            self.runner = self.drafter = None
            self.ensure(tokens)
            return
        self.capacity = cap
