"""A batched static-shape generation engine: fixed KV caches of B rows, continuous batching,
one CUDA graph per decode step. The fast backend of regeneration and synthesis.

Why: HF `generate` on a small target is launch-bound (a few hundred kernels and much Python
per step), and a left-padded batch keeps decoding rows that stopped long ago while the longest
answer finishes. Here:
- Cache: per layer a [B, Hkv, L, D] buffer (static_decode._SlotCache with rows). Every row has
  its own length: a row's token at position p is written at slot p of its row, and a 4D mask
  (key slot <= p) hides everything past it. Stale K/V of a previous prompt is never cleared:
  it lies beyond the new prompt and every decode step writes its slot before attending to it.
- Decode step: the B rows' next tokens at their own positions, the logits, the choice of the
  next token and the position advance form one static shape, replayed as one CUDA graph on
  a GPU (run eagerly on CPU: the same code, the "static" path the tests check).
- Continuous batching, conversations, cache lengths: which prompt runs in which row, and
  when, is data/engine_schedule.py's part (its docstring). In short: a row that stops takes
  the next waiting prompt (refills grouped: `refill_rows` free rows at a time on a GPU, as
  an eager prefill costs as much as many graph steps; prefilled together, left-padded, the
  padded columns given the positions after the prompt, so each row still writes slots
  0..W-1 once and reads its last token's logits in the last column). A conversation's next
  turn continues in the row that holds it, only the tokens after the longest common prefix
  with what the row holds prefilled, attending to the row's cache (`reuse_prefix`). The
  cache length L is a power of two covering prompt + max_new_tokens, served shortest first;
  when a length has drained to fewer than half its rows busy and longer prompts wait, its
  busy rows move with their caches into the next length's cache (`carry_rows`) rather than
  leaving the rows idle until the last answer ends.
- Attention: a decode step of a grouped-query target attends to each key/value head once
  (data/grouped_decode.py); the cache read is what a step costs, so copying heads would
  triple it.
- One step in flight: the host reads a step's tokens and does its bookkeeping (stop checks,
  the loop stop) while the GPU runs the next step, so host work costs no GPU time
  (engine_state.StepTokens).
- Sampling: greedy (argmax), or temperature / top_p with noise drawn from a counter-based hash
  of (row key, position): a prompt's answer depends on its key and the seed only, not on which
  rows ran beside it, so a resumed job draws what an uninterrupted one would have.

Supported: the targets static_decode.static_support accepts (attention-only, no sliding
window, sdpa or eager attention, one device). Greedy answers equal HF `generate`'s token for
token in fp32 (tests/test_regen_engine.py).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from dflash_trainer.data.engine_schedule import Scheduler
from dflash_trainer.data.engine_state import (
    EngineStats,
    Follow,
    Shape,
    StepTokens,
    flex_decode,
    kv_bytes_per_position,
    prefill_inputs,
)
from dflash_trainer.data.grouped_decode import grouped_decode, sdpa_backends, sdpa_scope
from dflash_trainer.data.sampling import item_key, pick_tokens
from dflash_trainer.data.settings import GenerationSettings
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.static_decode import _Replay, _SlotCache, static_support
from dflash_trainer.eval.target_runner import cache_kwarg


class StaticBatchEngine:
    """Regeneration's `Generator` over fixed-size caches (see the module docstring)."""

    max_batch: int | None = None  # the whole round at once: the engine batches by itself

    def __init__(
        self,
        model: Any,
        settings: GenerationSettings,
        stops: list[int],
        pad_id: int,
        rows: int = 64,
        graphs: bool | None = None,
        refill_rows: int | None = None,
        prefill_tokens: int | None = None,
        kv_fraction: float = 0.5,
        prefill_align: int | None = None,
        compile_decode: bool = False,
        reuse_prefix: bool = True,
        compile_prefill: bool = False,
        carry_rows: bool = True,
        decode_attention: str = "sdpa",
        decode_sdpa: str | None = None,
        prefill_sdpa: str | None = None,
    ) -> None:
        why = static_support(model)
        if why is not None:
            raise DFlashError(f"the static engine cannot run this target: {why}")
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        cuda = self.device.type == "cuda"
        self.graphs = cuda if graphs is None else graphs
        self.max_rows = rows
        self.refill_rows = refill_rows
        self.prefill_tokens = prefill_tokens or (32768 if cuda else 4096)
        self.prefill_align = prefill_align or (64 if cuda else 1)
        # A small target's decode step is a few kernels per op and layer: compiling fuses the
        # elementwise ones (norms, rotary, activation, sampling). Compiled with symbolic rows
        # and cache length, once for every shape (a compile of a 30-layer target takes most of
        # a minute; static shapes would pay it per cache length).
        self._step = torch.compile(self._decode, dynamic=True) if compile_decode else self._decode
        # Prefills are eager forwards of new shapes each time (rows x width); compiled with
        # symbolic shapes they fuse the same small kernels (two graphs: fresh rows and rows
        # continuing after their history).
        self._prefill_forward = (
            torch.compile(self._forward_prefill, dynamic=True)
            if compile_prefill
            else self._forward_prefill
        )
        self.reuse_prefix = reuse_prefix
        self.carry_rows = carry_rows
        self.flex = flex_decode(decode_attention, compile_decode)
        self._decode_kernels = sdpa_backends(decode_sdpa)
        self._prefill_kernels = sdpa_backends(prefill_sdpa)
        self.kv_fraction = kv_fraction
        self.settings = settings
        self.stop_set = set(stops)
        self.cache_kwarg = cache_kwarg(model)
        impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        self.bool_mask = impl != "eager"
        self.calls = 0
        self.stats = EngineStats()
        self._built: dict[int, Shape] = {}  # cache length -> its built shape
        self._replay: _Replay | None = None
        self.shape: Shape | None = None
        """The active shape: the cache that decode steps and prefills run on."""
        self._tokens = StepTokens()
        self.cache = _SlotCache(1, 1)
        self.oom_splits = 0
        self.trace: list[tuple[int, int, int, int, int]] | None = None
        """When a list: one (cache length, rows, rows busy, prompts queued in this length,
        prompts waiting for a longer one) per decode step (benchmarks/regenerate_occupancy.py)."""

    # --- building a shape

    def _rows_wanted(self, wanted: int) -> int:
        """Rows for `wanted` prompts: the batch size, or fewer when few prompts wait (a power
        of two, so that later groups reuse the shape)."""
        return min(self.max_rows, 1 << math.ceil(math.log2(max(wanted, 1))))

    def _rows_for(self, length: int, wanted: int) -> int:
        """Rows for `wanted` prompts in a cache of `length` positions: fewer than wanted when
        memory is short."""
        rows = self._rows_wanted(wanted)
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            fit = int(self.kv_fraction * free) // (length * kv_bytes_per_position(self.model))
            rows = max(1, min(rows, fit))
        return rows

    def _drop(self, lengths: list[int]) -> None:
        """Free the shapes of these cache lengths (buffers and graph pools)."""
        for length in lengths:
            del self._built[length]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _activate(self, shape: Shape) -> None:
        self.shape = shape
        self.cache, self.ids, self.pos, self.keys = shape.cache, shape.ids, shape.pos, shape.keys
        self.row_ix, self.cols, self.length = shape.row_ix, shape.cols, shape.length
        self._replay = shape.replay

    def _build(self, rows: int, length: int) -> Shape:
        """Caches, static inputs and the decode step (captured on CUDA) for this shape."""
        dev = self.device
        shape = Shape(
            rows=rows,
            length=length,
            cache=_SlotCache(length, rows),
            ids=torch.full((rows, 1), self.pad_id, dtype=torch.long, device=dev),
            pos=torch.zeros(rows, dtype=torch.long, device=dev),
            keys=torch.zeros(rows, dtype=torch.long, device=dev),
            row_ix=torch.arange(rows, device=dev),
            cols=torch.arange(length, device=dev),
        )
        self._activate(shape)
        with torch.inference_mode():
            self._decode()  # allocates every layer's buffer before any capture
            try:
                shape.replay = _Replay(self._step, self.graphs)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # a capture that fails names the op; eager still works
                if not self.graphs and self._step == self._decode:
                    raise
                if self.flex:  # uncompiled FlexAttention would run, correct but very slow
                    raise DFlashError(
                        f"the compiled decode step with flex attention failed ({type(e).__name__}:"
                        f" {e}); run without --decode-attention flex"
                    ) from e
                print(
                    f"dflash: decode step capture or compile failed ({type(e).__name__}: {e}); "
                    "the engine continues eagerly",
                    file=sys.stderr,
                )
                self.graphs, self._step = False, self._decode
                shape.replay = _Replay(self._decode, False)
        shape.pos.zero_()
        self._activate(shape)
        self.stats.builds += 1
        self.stats.shapes.append((rows, length))
        return shape

    def _ensure(self, length: int, wanted: int) -> int:
        """Activate a shape for `wanted` prompts of this cache length, built once per length
        and kept (the next round or window reuses its graph); its rows."""
        need = min(self.max_rows, wanted)
        shape = self._built.get(length)
        if shape is not None and (shape.rows >= need or shape.capped):
            self._activate(shape)
            return shape.rows
        if shape is not None:
            self._drop([length])  # too few rows for this group: rebuilt bigger
        t0 = time.perf_counter()
        rows = self._rows_for(length, wanted)
        if rows < need and self._built:  # other lengths' caches hold the memory: free them
            self._drop(list(self._built))
            rows = self._rows_for(length, wanted)
        capped = rows < need
        while True:
            try:
                shape = self._build(rows, length)
                break
            except torch.OutOfMemoryError:
                self._drop(list(self._built))
                if rows == 1:
                    raise DFlashError(
                        f"out of GPU memory building a 1-row cache of {length} positions; "
                        "lower --max-prompt-tokens or --max-new-tokens, or free the GPU"
                    ) from None
                self.oom_splits += 1
                capped = True
                rows //= 2
        shape.capped = capped
        self._built[length] = shape
        self.stats.build_s += time.perf_counter() - t0
        return rows

    # --- forwards

    def _mask(self, ok: torch.Tensor) -> torch.Tensor:
        if self.bool_mask:
            return ok
        dtype = self.model.dtype
        zero = torch.zeros((), dtype=dtype, device=ok.device)
        return torch.where(ok, zero, torch.finfo(dtype).min)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=self._mask(mask)[:, None],
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kwarg: self.cache},
        )
        return out.logits[:, -1].float()

    def _forward_prefill(
        self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        with sdpa_scope(self._prefill_kernels):
            return self._forward(ids, pos, mask)

    def _pick(self, logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        s = self.settings
        return pick_tokens(logits, s.temperature, s.top_p, keys, steps)

    def _decode(self) -> torch.Tensor:
        """One step of every row (the static shape the graph replays)."""
        self.cache.rows, self.cache.positions, self.cache.fresh = (
            self.row_ix,
            self.pos[:, None],
            False,
        )
        mask = (self.cols[None, :] <= self.pos[:, None])[:, None, :]  # [B, 1, L]
        with sdpa_scope(self._decode_kernels):
            logits = self._forward(self.ids, self.pos[:, None], mask)
        tok = self._pick(logits, self.keys, self.pos)
        self.ids.copy_(tok[:, None])
        # Idle rows keep stepping; the clamp keeps them inside the buffer (a live row never
        # gets there: L >= prompt + max_new_tokens).
        self.pos.add_(1).clamp_(max=self.cols.shape[0] - 1)
        return tok

    def _prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        keys: list[int],
        starts: list[int] | None = None,
    ) -> list[int]:
        """Feed prompts into cache rows `slots`; their first new tokens.

        Fresh rows (`starts` None) attend only to what they are fed. With `starts`, row i
        already holds the first starts[i] tokens of prompt i (its conversation so far): only
        the rest is fed, attending to the row's cache up to each position."""
        ids, pos, real = prefill_inputs(
            prompts, starts, self.pad_id, self.prefill_align, self.length
        )
        dev = self.device
        ids, pos, real = ids.to(dev), pos.to(dev), real.to(dev)
        if starts is None:
            mask = (pos[:, None, :] <= pos[:, :, None]) & real[:, None, :]  # [k, Wq, Wk]
        else:
            mask = self.cols[None, None, :] <= pos[:, :, None]  # [k, Wq, L]: the row's cache
        slots_t = torch.tensor(slots, dtype=torch.long, device=dev)
        keys_t = torch.tensor(keys, dtype=torch.long, device=dev)
        self.cache.rows, self.cache.positions = slots_t, pos
        self.cache.fresh, self.cache.subset = starts is None, starts is not None
        try:
            logits = self._prefill_forward(ids, pos, mask)
        finally:
            self.cache.subset = False
        first = self._pick(logits, keys_t, pos[:, -1])
        self.ids[slots_t] = first[:, None]
        self.pos[slots_t] = pos[:, -1] + 1
        self.keys[slots_t] = keys_t
        self.stats.prefills += 1
        return first.tolist()

    # --- serving (data/engine_schedule.py decides which prompt runs in which row, and when)

    def generate(self, prompts: list[list[int]], keys: list[int] | None = None) -> list[list[int]]:
        """New token ids per prompt, ending at the first stop id or after max_new_tokens.

        `keys` seed each prompt's sampling (default: the job's seed, this call's number and the
        prompt's index); greedy decoding ignores them.
        """
        if keys is None:
            keys = [item_key(self.settings.seed, self.calls, i) for i in range(len(prompts))]
        return self._serve(list(prompts), list(keys), None)

    def generate_chains(self, first: list[tuple[list[int], int]], follow: Follow) -> None:
        """Chains of prompts, each next one known only once the previous is answered (the
        turns of a conversation): `follow(chain, new_ids)` gets every answer and returns the
        chain's next (prompt, key), or None when it ends. A next prompt is queued at once, in
        the running cache length or a longer one, so rows never wait for a round to drain."""
        self._serve([p for p, _ in first], [k for _, k in first], follow)

    def _serve(
        self, prompts: list[list[int]], keys: list[int], follow: Follow | None
    ) -> list[list[int]]:
        self.calls += 1
        with torch.inference_mode(), grouped_decode(self.model, self.flex):
            return Scheduler(self, prompts, keys, follow).run()

    def _rows_at(self, length: int, wanted: int) -> int:
        """The rows `_ensure(length, wanted)` would give, memory aside."""
        shape = self._built.get(length)
        if shape is not None and (shape.rows >= min(self.max_rows, wanted) or shape.capped):
            return shape.rows
        return self._rows_wanted(wanted)

    def _room_beside(self, length: int, wanted: int, carried: int) -> bool:
        """Whether a shape of `length` for `wanted` prompts, `carried` of them rows moved in
        from the active shape, can be had while the active one is still held: a built one
        with room for the carried rows, or a new one that memory gives every row it asks for
        beside the active one (never one capped for it: it would stay capped for the call)."""
        shape = self._built.get(length)
        if shape is not None and (shape.rows >= min(self.max_rows, wanted) or shape.capped):
            return shape.rows >= carried
        return self._rows_for(length, wanted) >= self._rows_wanted(wanted)

    def _move_rows(self, src: Shape, rows: list[tuple[int, int]]) -> dict[int, int]:
        """Copy rows (slot in `src`, prompt) into the first rows of the active, longer shape:
        each row's K/V at the same positions, its next token, position and sampling key. The
        new rows for their prompts."""
        dev = self.device
        old = torch.tensor([slot for slot, _ in rows], dtype=torch.long, device=dev)
        new = torch.arange(len(rows), device=dev)
        n = src.length
        for layer, k in src.cache.keys.items():  # one cache row per slot: [rows, Hkv, L, D]
            self.cache.keys[layer][new, :, :n] = k[old]
            self.cache.values[layer][new, :, :n] = src.cache.values[layer][old]
        self.ids[new] = src.ids[old]
        self.pos[new] = src.pos[old]
        self.keys[new] = src.keys[old]
        return {slot: i for slot, (_, i) in enumerate(rows)}


def engine_notice(model: Any) -> str | None:
    """None when the engine can run `model` on its device, else why (for a one-line notice)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"the target is on {device.type}, the static engine is the GPU default"
    return static_support(model)
