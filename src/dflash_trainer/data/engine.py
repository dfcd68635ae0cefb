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
- Continuous batching: a row that stops is refilled with the next waiting prompt; refills are
  grouped (`refill_rows` free rows at a time on a GPU: an eager prefill costs as much as many
  graph steps) and prefilled together, left-padded. Padded columns get the positions after
  the prompt, so each row still writes slots 0..W-1 once and reads its last token's logits in
  the last column.
- Conversations (`generate_chains`): a turn's next prompt is the conversation so far plus the
  new user turn. When it fits the same cache length it continues in the row that already
  holds the conversation: only the tokens after the longest common prefix with what the row
  holds are prefilled, attending to the row's cache (`reuse_prefix`). Without this every turn
  prefilled the whole history again, the larger part of turn-by-turn regeneration's work.
- Length buckets: prompts are served shortest first, and the cache length L is a power of two
  covering prompt + max_new_tokens; a longer prompt waits until the batch drains, then the
  cache and graph are rebuilt for the next bucket (short prompts do not pay for long ones).
- Attention: a decode step of a grouped-query target attends to each key/value head once
  (data/grouped_decode.py); the cache read is what a step costs, so copying heads would
  triple it.
- One step in flight: the host reads a step's tokens and does its bookkeeping (stop checks,
  the loop stop) while the GPU runs the next step, so host work costs no GPU time.
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
from collections import deque
from typing import Any

import torch

from dflash_trainer.data.engine_state import (
    EngineStats,
    Flight,
    Follow,
    Rows,
    Shape,
    StepTokens,
    Work,
    cache_length,
    common_prefix,
    flex_decode,
    kv_bytes_per_position,
    prefill_inputs,
)
from dflash_trainer.data.grouped_decode import grouped_decode, sdpa_backends, sdpa_scope
from dflash_trainer.data.loop_tails import loops_now
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
        self._tokens = StepTokens()
        self.cache = _SlotCache(1, 1)
        self.oom_splits = 0
        self.trace: list[tuple[int, int, int, int, int]] | None = None
        """When a list: one (cache length, rows, rows busy, prompts queued in this length,
        prompts waiting for a longer one) per decode step (benchmarks/regenerate_occupancy.py)."""
        self._pending: dict[int, list[int]] = {}

    # --- building a shape

    def _rows_for(self, length: int, wanted: int) -> int:
        """Rows for a cache of `length` positions: the batch size, or fewer when few prompts
        wait (a power of two, so that later groups reuse the shape) or memory is short."""
        rows = min(self.max_rows, 1 << math.ceil(math.log2(max(wanted, 1))))
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

    # --- scheduling

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
        """Cache lengths served shortest first; answers in the order of `prompts`."""
        self.calls += 1
        outs: list[list[int]] = [[] for _ in prompts]
        chain = list(range(len(prompts)))
        new = self.settings.max_new_tokens
        pending: dict[int, list[int]] = {}
        self._pending = pending
        for i, p in enumerate(prompts):
            pending.setdefault(cache_length(len(p) + new), []).append(i)
        current = 0

        def on_done(i: int) -> int | None:
            """The next prompt of i's chain, if it runs in the current cache length."""
            nxt = follow(chain[i], outs[i]) if follow is not None else None
            if nxt is None:
                return None
            j = len(prompts)
            prompts.append(nxt[0])
            keys.append(nxt[1])
            chain.append(chain[i])
            outs.append([])
            length = cache_length(len(nxt[0]) + new)  # prompts only grow: never a past one
            if length == current:
                return j
            pending.setdefault(length, []).append(j)
            return None

        with torch.inference_mode(), grouped_decode(self.model, self.flex):
            while pending:
                current = min(pending)
                group = sorted(pending.pop(current), key=lambda i: len(prompts[i]))
                self._run_group(current, group, Work(prompts, keys, outs, on_done))
        return outs

    def _run_group(self, length: int, group: list[int], work: Work) -> None:
        """Continuous batching over prompts of one cache length (shortest first). One decode
        step stays in flight: the host reads a step's tokens and does its bookkeeping while
        the GPU runs the next one (rows that stopped step once more, as idle rows do); a
        refill first reads the step in flight, since it changes rows under it."""
        rows = self._ensure(length, len(group))
        default_refill = max(1, rows // 8) if self.device.type == "cuda" else 1
        refill_at = min(self.refill_rows or default_refill, rows)
        g = Rows(deque(group), list(range(rows)))
        flight: Flight | None = None
        while g.queue or g.live or g.cont or flight is not None:
            waiting = len(g.queue) + len(g.cont)
            fillable = min(len(g.free), len(g.queue)) + len(g.cont)
            refill = bool(waiting) and (not g.live or fillable >= min(refill_at, waiting))
            if flight is not None and (refill or not g.live):
                self._take(flight, g, work)
                flight = None
            elif refill:
                self._refill(g, work)
            else:
                assert self._replay is not None
                launched = self._tokens.queue(self._replay())
                self.stats.decode_steps += 1
                self.stats.row_steps += rows
                if flight is not None:
                    self._take(flight, g, work)
                flight = launched

    def _take(self, read: Flight, g: Rows, work: Work) -> None:
        """A step's tokens for the rows still live. No row joins while a step is in flight
        (a refill reads it first), so these were all live at its launch; a row that stopped
        at the step before got a token past its end, dropped with the row."""
        t0 = time.perf_counter()
        tok = read()
        t1 = time.perf_counter()
        self.stats.row_steps_busy += len(g.live)
        if self.trace is not None:
            waiting = sum(map(len, self._pending.values()))
            queued = len(g.queue) + len(g.cont)
            self.trace.append((self.length, len(self.pos), len(g.live), queued, waiting))
        for slot, i in list(g.live.items()):
            work.outs[i].append(tok[slot])
            if self._done(work.outs[i]):
                del g.live[slot]
                self._retire(slot, i, g, work)
        self.stats.decode_s += t1 - t0
        self.stats.host_s += time.perf_counter() - t1

    def _done(self, toks: list[int]) -> bool:
        return (
            toks[-1] in self.stop_set
            or len(toks) >= self.settings.max_new_tokens
            or (self.settings.stop_loops and loops_now(toks))
        )

    def _retire(self, slot: int, i: int, g: Rows, work: Work) -> None:
        """Prompt i (in row `slot`) is answered. Its chain's next prompt, when it runs in this
        cache length, continues in the same row after the history the row already holds
        (the turns of a conversation: only the new user turn is prefilled); otherwise it
        waits in the queue and the row is free."""
        j = work.on_done(i)
        if j is not None and self.reuse_prefix:
            c = min(common_prefix(work.cached(i), work.prompts[j]), len(work.prompts[j]) - 1)
            if c > 0:
                g.cont.append((slot, j, c))
                return
        if j is not None:
            g.queue.append(j)
        g.free.append(slot)

    def _admit(
        self, g: Rows, work: Work, slots: list[int], idx: list[int], firsts: list[int]
    ) -> None:
        for slot, i, t in zip(slots, idx, firsts):
            work.outs[i].append(t)
            if self._done(work.outs[i]):
                self._retire(slot, i, g, work)
            else:
                g.live[slot] = i

    def _refill(self, g: Rows, work: Work) -> None:
        """Prefill waiting prompts, in chunks of at most prefill_tokens: continuations in
        their own rows first, then new prompts into the free rows."""
        t0 = time.perf_counter()
        while g.cont:
            g.cont.sort(key=lambda e: len(work.prompts[e[1]]) - e[2])
            chunk = [g.cont.pop(0)]
            # Each continuing row attends to (and gathers, per layer) its whole cache row, so
            # rows x L is bounded as well as the fed tokens.
            most_rows = max(1, 8 * self.prefill_tokens // self.length)
            while (
                g.cont
                and len(chunk) < most_rows
                and (len(chunk) + 1) * (len(work.prompts[g.cont[0][1]]) - g.cont[0][2])
                <= self.prefill_tokens
            ):
                chunk.append(g.cont.pop(0))
            slots, idx, starts = (list(x) for x in zip(*chunk))
            firsts = self._prefill(
                slots, [work.prompts[i] for i in idx], [work.keys[i] for i in idx], starts
            )
            self.stats.continued += len(chunk)
            self.stats.reused_tokens += sum(starts)
            self._admit(g, work, slots, idx, firsts)
        g.free.sort()
        take = [g.queue.popleft() for _ in range(min(len(g.free), len(g.queue)))]
        take.sort(key=lambda i: len(work.prompts[i]))  # chains queue longer prompts late
        while take:
            chunk_i = [take.pop(0)]
            while take and (len(chunk_i) + 1) * len(work.prompts[take[0]]) <= self.prefill_tokens:
                chunk_i.append(take.pop(0))  # sorted by length: the last is the widest
            slots = [g.free.pop(0) for _ in chunk_i]
            firsts = self._prefill(
                slots, [work.prompts[i] for i in chunk_i], [work.keys[i] for i in chunk_i]
            )
            self._admit(g, work, slots, chunk_i, firsts)
        self.stats.prefill_s += time.perf_counter() - t0


def engine_notice(model: Any) -> str | None:
    """None when the engine can run `model` on its device, else why (for a one-line notice)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"the target is on {device.type}, the static engine is the GPU default"
    return static_support(model)
