"""Which prompt runs in which cache row of the static engine, and when (data/engine.py builds
the caches and runs the forwards; this decides what they are fed).

- Cache lengths: a prompt needs a cache of L = cache_length(prompt + max_new_tokens)
  positions. Lengths are served shortest first, so short prompts do not pay for the reads of
  long caches; within a length, continuous batching: a row whose answer ends takes the next
  waiting prompt (refills grouped on a GPU, engine.py).
- Conversations (`follow`): a turn's answer queues the conversation's next turn at once. A
  next turn that fits the running cache continues in the row that holds its conversation
  (only the tokens after what the row holds are prefilled); one that outgrows it waits for
  its length.
- No drain between lengths (`carry_rows`): once a length has nothing left to admit, its
  rows only empty out, one answer at a time, while prompts of the next length wait; with
  turn-by-turn work the last conversations of a length hold it turn after turn. So when
  fewer than half the rows are busy and a longer length has prompts waiting, the busy rows
  move into the next length's cache, each with its K/V (copied to the same positions: only
  the cache behind them is longer), its next token, position and sampling key, and the
  waiting prompts start beside them. Their later turns continue in the cache they now hold
  while they fit it, so within a call the lengths only grow and none is revisited.
  The cost rule: a dense decode step reads rows x L cache slots whether a row is busy or
  idle, so moving rows into a cache twice as long pays only where they take rows that cache
  would step idle anyway (its rows are a power of two over the prompts it gets). Rows are
  carried only when they fit there without adding rows; then the shorter cache is not
  stepped any more, and every step it would have run for its last answers is saved. Until
  they fit, the shorter length keeps draining (benchmarks/regenerate_occupancy.py measures
  what each rule costs: a looser one raised the slots read per answered token).
- Memory: the longer cache is built beside the shorter one, so rows are carried only when
  memory gives the longer length, with the shorter still held, every row it asks for;
  otherwise the shorter length drains first, as it did before carrying (on a GPU the long
  lengths' rows are capped by free memory, so those transitions drain), and so do carried
  rows that a build which ran out of memory leaves no room for.
- Shapes stay static: each length keeps one (rows, L) decode shape, captured once, of the
  rows it would have had without carrying; no new shape. The copy of carried rows is an
  eager indexed copy between two built caches, outside any graph.
- One step in flight: the host reads a step's tokens and does its bookkeeping (stop checks,
  the loop stop) while the device runs the next step; a refill or a carry first reads the
  step in flight, since it changes rows under it.

A prompt's tokens depend only on its prompt, its key and the positions it is decoded at,
never on where or beside what it ran: greedy answers are the same with or without carrying
(tests/test_regen_engine.py), and sampled ones too (keyed by row key and position).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

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
)
from dflash_trainer.data.loop_tails import loops_now
from dflash_trainer.data.settings import GenerationSettings
from dflash_trainer.eval.static_decode import _Replay


class Engine(Protocol):
    """What the scheduler asks of the engine (data/engine.py's StaticBatchEngine): named here
    so that this module does not import the engine that imports it."""

    settings: GenerationSettings
    stop_set: set[int]
    reuse_prefix: bool
    carry_rows: bool
    device: torch.device
    refill_rows: int | None
    prefill_tokens: int
    stats: EngineStats
    shape: Shape | None
    length: int
    pos: torch.Tensor
    trace: list[tuple[int, int, int, int, int]] | None
    _replay: _Replay | None
    _tokens: StepTokens

    def _activate(self, shape: Shape) -> None: ...
    def _ensure(self, length: int, wanted: int) -> int: ...
    def _rows_at(self, length: int, wanted: int) -> int: ...
    def _room_beside(self, length: int, wanted: int, carried: int) -> bool: ...
    def _move_rows(self, src: Shape, rows: list[tuple[int, int]]) -> dict[int, int]: ...
    def _prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        keys: list[int],
        starts: list[int] | None = None,
    ) -> list[int]: ...


@dataclass
class Carry:
    """Rows leaving a drained-down cache length for the next one: the shape that holds them
    and which prompt each row (slot) is answering."""

    shape: Shape
    live: dict[int, int]


class Scheduler:
    """One engine call: its prompts (growing as chains add next turns), their answers, and
    the prompts that wait for a longer cache length."""

    def __init__(
        self,
        engine: Engine,
        prompts: list[list[int]],
        keys: list[int],
        follow: Follow | None,
    ) -> None:
        self.e = engine
        self.follow = follow
        self.work = Work(prompts, keys, [[] for _ in prompts], self._on_done)
        self.chain = list(range(len(prompts)))
        self.pending: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            self.pending.setdefault(self._length(p), []).append(i)
        self.current = 0

    def _length(self, prompt: list[int]) -> int:
        return cache_length(len(prompt) + self.e.settings.max_new_tokens)

    def run(self) -> list[list[int]]:
        """Cache lengths shortest first; answers in the order of the prompts."""
        carry: Carry | None = None
        while self.pending:
            self.current = min(self.pending)
            group = self.pending.pop(self.current)
            group.sort(key=lambda i: len(self.work.prompts[i]))
            carry = self._start(group, carry)
        return self.work.outs

    def _on_done(self, i: int) -> int | None:
        """The next prompt of i's chain, if it runs in the current cache length."""
        nxt = self.follow(self.chain[i], self.work.outs[i]) if self.follow is not None else None
        if nxt is None:
            return None
        w, j = self.work, len(self.work.prompts)
        w.prompts.append(nxt[0])
        w.keys.append(nxt[1])
        w.outs.append([])
        self.chain.append(self.chain[i])
        length = self._length(nxt[0])
        if length <= self.current:  # shorter: a conversation carried up from a shorter length
            return j
        self.pending.setdefault(length, []).append(j)  # longer than any served yet
        return None

    # --- a cache length's group

    def _start(self, group: list[int], carry: Carry | None) -> Carry | None:
        """Run the current length's prompts beside the rows carried into it; the rows to
        carry into the next length, if it starts before this one has drained."""
        e = self.e
        carried = len(carry.live) if carry is not None else 0
        rows = e._ensure(self.current, len(group) + carried)
        g = Rows(deque(group), list(range(rows)))
        if carry is not None:
            if rows < carried:
                self._drain_carried(group, carry)
                return None
            g.live = e._move_rows(carry.shape, list(carry.live.items()))
            g.free = list(range(carried, rows))
        return self._loop(g, rows, carrying=e.carry_rows)

    def _drain_carried(self, group: list[int], carry: Carry) -> None:
        """The longer cache came out with fewer rows than the carried ones (memory): they
        finish in their own cache first, and the longer length's prompts wait for them."""
        self.pending[self.current] = group + self.pending.get(self.current, [])
        self.current = carry.shape.length
        self.e._activate(carry.shape)
        free = [s for s in range(carry.shape.rows) if s not in carry.live]
        self._loop(Rows(deque(), free, dict(carry.live)), carry.shape.rows, carrying=False)

    def _loop(self, g: Rows, rows: int, carrying: bool) -> Carry | None:
        """Continuous batching over the group's rows. One decode step stays in flight: the
        host reads a step's tokens and does its bookkeeping while the device runs the next
        (rows that stopped step once more, as idle rows do); a refill or a carry first reads
        the step in flight, since it changes rows under it."""
        e = self.e
        default_refill = max(1, rows // 8) if e.device.type == "cuda" else 1
        refill_at = min(e.refill_rows or default_refill, rows)
        flight: Flight | None = None
        while g.queue or g.live or g.cont or flight is not None:
            waiting = len(g.queue) + len(g.cont)
            fillable = min(len(g.free), len(g.queue)) + len(g.cont)
            refill = bool(waiting) and (not g.live or fillable >= min(refill_at, waiting))
            carry = carrying and not waiting and self._carry_now(g, rows)
            if flight is not None and (refill or not g.live or carry):
                self._take(flight, g)
                flight = None
            elif refill:
                self._refill(g)
            elif carry:
                e.stats.carries += 1
                e.stats.carried_rows += len(g.live)
                assert e.shape is not None
                return Carry(e.shape, dict(g.live))
            else:
                assert e._replay is not None
                launched = e._tokens.queue(e._replay())
                e.stats.decode_steps += 1
                e.stats.row_steps += rows
                if flight is not None:
                    self._take(flight, g)
                flight = launched
        return None

    def _carry_now(self, g: Rows, rows: int) -> bool:
        """Whether the busy rows should move into the next cache length now: fewer than half
        are busy, prompts wait there, the busy rows fit into rows that length's cache would
        have idle beside its waiting prompts, and it can be built beside this one."""
        if not self.pending or not g.live or 2 * len(g.live) >= rows or g.no_carry:
            return False
        e, nxt = self.e, min(self.pending)
        waiting, busy = len(self.pending[nxt]), len(g.live)
        if e._rows_at(nxt, waiting + busy) > e._rows_at(nxt, waiting):
            return False  # they would add rows to every step there: later, when fewer are busy
        if e._room_beside(nxt, waiting + busy, busy):
            return True
        g.no_carry = True  # memory does not change within the group: do not ask every step
        return False

    # --- rows

    def _take(self, read: Flight, g: Rows) -> None:
        """A step's tokens for the rows still live. No row joins while a step is in flight
        (a refill reads it first), so these were all live at its launch; a row that stopped
        at the step before got a token past its end, dropped with the row."""
        e, outs = self.e, self.work.outs
        t0 = time.perf_counter()
        tok = read()
        t1 = time.perf_counter()
        e.stats.row_steps_busy += len(g.live)
        if e.trace is not None:
            longer = sum(map(len, self.pending.values()))
            e.trace.append((e.length, len(e.pos), len(g.live), len(g.queue) + len(g.cont), longer))
        for slot, i in list(g.live.items()):
            outs[i].append(tok[slot])
            if self._done(outs[i]):
                del g.live[slot]
                self._retire(slot, i, g)
        e.stats.decode_s += t1 - t0
        e.stats.host_s += time.perf_counter() - t1

    def _done(self, toks: list[int]) -> bool:
        s = self.e.settings
        return (
            toks[-1] in self.e.stop_set
            or len(toks) >= s.max_new_tokens
            or (s.stop_loops and loops_now(toks))
        )

    def _retire(self, slot: int, i: int, g: Rows) -> None:
        """Prompt i (in row `slot`) is answered. Its chain's next prompt, when it runs in this
        cache length, continues in the same row after the history the row already holds
        (the turns of a conversation: only the new user turn is prefilled); otherwise it
        waits in the queue and the row is free."""
        w = self.work
        j = w.on_done(i)
        if j is not None and self.e.reuse_prefix:
            c = min(common_prefix(w.cached(i), w.prompts[j]), len(w.prompts[j]) - 1)
            if c > 0:
                g.cont.append((slot, j, c))
                return
        if j is not None:
            g.queue.append(j)
        g.free.append(slot)

    def _admit(self, g: Rows, slots: list[int], idx: list[int], firsts: list[int]) -> None:
        outs = self.work.outs
        for slot, i, t in zip(slots, idx, firsts):
            outs[i].append(t)
            if self._done(outs[i]):
                self._retire(slot, i, g)
            else:
                g.live[slot] = i

    def _refill(self, g: Rows) -> None:
        """Prefill waiting prompts, in chunks of at most prefill_tokens: continuations in
        their own rows first, then new prompts into the free rows."""
        e, w = self.e, self.work
        t0 = time.perf_counter()
        while g.cont:
            g.cont.sort(key=lambda c: len(w.prompts[c[1]]) - c[2])
            chunk = [g.cont.pop(0)]
            # Each continuing row attends to (and gathers, per layer) its whole cache row, so
            # rows x L is bounded as well as the fed tokens.
            most_rows = max(1, 8 * e.prefill_tokens // e.length)
            while (
                g.cont
                and len(chunk) < most_rows
                and (len(chunk) + 1) * (len(w.prompts[g.cont[0][1]]) - g.cont[0][2])
                <= e.prefill_tokens
            ):
                chunk.append(g.cont.pop(0))
            slots, idx, starts = (list(x) for x in zip(*chunk))
            firsts = e._prefill(
                slots, [w.prompts[i] for i in idx], [w.keys[i] for i in idx], starts
            )
            e.stats.continued += len(chunk)
            e.stats.reused_tokens += sum(starts)
            self._admit(g, slots, idx, firsts)
        g.free.sort()
        take = [g.queue.popleft() for _ in range(min(len(g.free), len(g.queue)))]
        take.sort(key=lambda i: len(w.prompts[i]))  # chains queue longer prompts late
        while take:
            chunk_i = [take.pop(0)]
            while take and (len(chunk_i) + 1) * len(w.prompts[take[0]]) <= e.prefill_tokens:
                chunk_i.append(take.pop(0))  # sorted by length: the last is the widest
            slots = [g.free.pop(0) for _ in chunk_i]
            firsts = e._prefill(
                slots, [w.prompts[i] for i in chunk_i], [w.keys[i] for i in chunk_i]
            )
            self._admit(g, slots, chunk_i, firsts)
        e.stats.prefill_s += time.perf_counter() - t0
