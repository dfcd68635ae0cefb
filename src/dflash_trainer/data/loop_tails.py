"""Loop tails: the end of an answer that repeats itself, taken out of supervision.

A small target decoding greedily often falls into a cycle (the same sentence, list item or
code line again and again) and stays there until `max_new_tokens` stops it. In the SmolLM2
set a third of the answers end that way and their loops hold two thirds of the completion
tokens. Such text is the easiest a drafter can see: once a cycle has been seen, every later
token is a copy. Uniform anchors then land mostly in loops, the in-batch acceptance looks
excellent, and the varied text that serving spends its steps on gets a third of the
gradient. The answer's end-of-turn token after a length stop is also not one the target
wrote: training on it teaches the drafter to stop inside a loop.

`mask` mode keeps the loop tokens in the document (later turns and the target's features
still see exactly what was generated) but stops supervising them: every token of a loop tail
past its first `KEEP` tokens leaves the loss mask, so no anchor lands there and no slot is
scored there (anchors need a supervised next token). Tokens after a document's last
supervised token are then dropped: nothing is predicted from them, and they would only take
pack space.

What counts as a loop, per supervised span (an assistant turn): a token whose preceding
`NGRAM` tokens (itself included) already occurred earlier in the span is a repeat. The loop
tail is the span's longest suffix in which no more than `MAX_GAP` non-repeats come in a row
(a counter or a changed word inside a cycle breaks up to NGRAM n-grams). It is a loop when it
is at least `MIN_LOOP` tokens long and at least `MIN_REPEATED` of it repeats (a numbered
list item repeated with its number changing is about half repeats). The first cycle
of a loop is new text and stays supervised; the tail starts at its second cycle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_trainer.data.template import TemplatedDoc

LOOP_TAILS = ("keep", "mask")


def prepared_mode(settings: Mapping[str, Any]) -> str:
    """The loop-tails mode a preparation's settings record: absent means keep (the default
    adds no key, so directories prepared before the option keep their fingerprint)."""
    return str(settings.get("loop_tails", "keep"))


NGRAM = 8
MAX_GAP = 12
MIN_LOOP = 128
MIN_REPEATED = 0.5
KEEP = 32
"""Loop tokens kept supervised: the drafter still learns that a cycle goes on."""

_MULT = np.uint64(0x9E3779B97F4A7C15)


def repeats(tokens: np.ndarray) -> np.ndarray:
    """Bool [n]: the NGRAM tokens ending at each position occurred earlier in `tokens`."""
    n = len(tokens)
    rep = np.zeros(n, dtype=bool)
    if n < NGRAM:
        return rep
    t = tokens.astype(np.uint64) + np.uint64(1)
    h = np.zeros(n - NGRAM + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):  # a 64-bit polynomial hash: wrapping is the point
        for k in range(NGRAM):
            h = h * _MULT + t[k : n - NGRAM + 1 + k]
    _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
    idx = np.arange(len(h))
    rep[NGRAM - 1 :] = first[inverse] < idx
    return rep


def _runs(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends (one past the last) of the runs of True in a bool array."""
    edges = np.diff(np.concatenate(([False], flags, [False])).astype(np.int8))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def loop_onset(tokens: np.ndarray) -> int | None:
    """Where a span's loop tail starts (its second cycle), or None if it has none."""
    if len(tokens) < MIN_LOOP + NGRAM:
        return None
    return _onset(repeats(tokens))


def _onset(rep: np.ndarray) -> int | None:
    """loop_onset from a span's repeat flags."""
    # Runs of non-repeats: the tail starts after the last run longer than MAX_GAP.
    starts, ends = _runs(~rep)
    long_runs = ends[(ends - starts) > MAX_GAP]
    begin = int(long_runs[-1]) if len(long_runs) else 0
    hits = np.flatnonzero(rep[begin:])
    if not len(hits):
        return None
    onset = begin + int(hits[0])
    tail = rep[onset:]
    if len(tail) < MIN_LOOP or tail.mean() < MIN_REPEATED:
        return None
    return onset


STOP_EVERY = 64
"""Regeneration's loop stop (`dflash data regenerate --stop-loops`) looks for a loop tail each
time an answer reaches a multiple of this many tokens. At fixed lengths, so that every backend
cuts an answer at the same place: the engine while it decodes, the others afterwards; and not
at every token, because a look costs tens of microseconds of host time per row."""
_FIRST_STOP = -(-(MIN_LOOP + NGRAM) // STOP_EVERY) * STOP_EVERY


def loop_stop(tokens: Sequence[int]) -> int | None:
    """The length regeneration's loop stop cuts an answer to: the first multiple of STOP_EVERY
    at which the answer so far has a loop tail; None if there is none.

    The answer keeps its first cycle and at least MIN_LOOP tokens of the loop, so a
    preparation with `--loop-tails mask` finds and masks the same tail it would have found in
    the whole looping answer; the tokens after the cut were copies of the cycle.
    """
    if len(tokens) < _FIRST_STOP:
        return None
    rep = repeats(np.asarray(tokens, dtype=np.int64))  # flags look back only: a prefix's
    for cut in range(_FIRST_STOP, len(tokens) + 1, STOP_EVERY):  # are the whole's
        if _onset(rep[:cut]) is not None:
            return cut
    return None


def loops_now(tokens: Sequence[int]) -> bool:
    """The engine's look while decoding: does `loop_stop` cut the answer at its current length?
    (Earlier looks found nothing, else the answer would have stopped there.)"""
    n = len(tokens)
    return (
        n % STOP_EVERY == 0
        and n >= _FIRST_STOP
        and loop_onset(np.asarray(tokens, dtype=np.int64)) is not None
    )


@dataclass
class LoopTally:
    """What `mask` mode did to a preparation, for its manifest."""

    answers: int = 0
    """Assistant turns with a loop tail."""
    unsupervised_tokens: int = 0
    """Supervised tokens taken out of the loss mask (those at a document's end are then also
    dropped, and counted again in trimmed_tokens)."""
    trimmed_tokens: int = 0
    """Tokens dropped after a document's last supervised token."""

    def to_dict(self, mode: str) -> dict[str, int | str]:
        return {"mode": mode, **self.__dict__}


def mask_loop_tails(doc: TemplatedDoc, tally: LoopTally) -> TemplatedDoc:
    """`doc` with its loop tails unsupervised and its unsupervised end dropped."""
    mask = doc.loss_mask.copy()
    starts, ends = _runs(doc.loss_mask)
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):  # Python ints: JSON counts
        onset = loop_onset(doc.input_ids[s:e])
        if onset is None:
            continue
        cut = s + onset + KEEP
        if cut < e:
            tally.answers += 1
            tally.unsupervised_tokens += e - cut
            mask[cut:e] = False
    supervised = np.flatnonzero(mask)
    end = int(supervised[-1]) + 1 if len(supervised) else len(mask)
    tally.trimmed_tokens += len(mask) - end
    return TemplatedDoc(doc.input_ids[:end], mask[:end], doc.repairs)
