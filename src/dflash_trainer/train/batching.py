"""Token-budget batching: which documents each optimizer step sees.

An epoch is a seeded permutation of the documents, cut greedily into steps whose
(truncated) token total fits `token_budget`. The order is a pure function of
(seed, epoch), so a resumed run continues at exactly the same (epoch, step) with the
same documents, and with several ranks step s of the epoch goes to rank s % world:
ranks see disjoint documents. A document longer than `max_doc_tokens` is truncated and
counted. A document whose kept tokens hold no supervised token after the first (a long user
turn before the answer, cut at `max_doc_tokens`) has no anchor to train: it is left out of
every epoch, where it would take target compute and budget (and, alone in a step, make the
step teach nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dflash_trainer.errors import DFlashError


class DocumentSource(Protocol):
    """What the trainer needs from a dataset (e.g. data.shards.PreparedDataset)."""

    @property
    def lengths(self) -> np.ndarray: ...

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> object: ...


@dataclass(frozen=True)
class Position:
    """Where the data stream stands: the next step is `step` of `epoch`."""

    epoch: int = 0
    step: int = 0


def left_out(
    lengths: Sequence[int] | np.ndarray, first_supervised: np.ndarray, max_doc_tokens: int
) -> np.ndarray:
    """Bool [N]: documents of at least 2 kept tokens whose kept window (`max_doc_tokens`)
    holds no supervised token after the first; epochs leave them out."""
    clipped = np.minimum(np.asarray(lengths, dtype=np.int64), max_doc_tokens)
    return (np.asarray(first_supervised) >= clipped) & (clipped >= 2)


def epoch_steps(
    lengths: Sequence[int] | np.ndarray,
    token_budget: int,
    max_doc_tokens: int,
    seed: int,
    epoch: int,
    first_supervised: np.ndarray | None = None,
) -> list[list[int]]:
    """The documents of every step of one epoch (before splitting over ranks).
    `first_supervised[i]`: document i's first supervised position after position 0 (its
    length if none); None treats every document as supervised."""
    n = len(lengths)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    clipped = np.minimum(np.asarray(lengths, dtype=np.int64), max_doc_tokens)
    if first_supervised is not None:  # nothing to learn inside the kept window: as if empty
        clipped = np.where(left_out(lengths, first_supervised, max_doc_tokens), 0, clipped)
    steps: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order.tolist():
        t = int(clipped[i])
        if t < 2:
            continue  # a 1-token document (or one unsupervised in its window) teaches nothing
        if cur and used + t > token_budget:
            steps.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += t
    if cur:
        steps.append(cur)
    return steps


def first_supervised_of(source: object) -> np.ndarray | None:
    """`source.first_supervised()` (a prepared dataset has it); None for a source without."""
    fn = getattr(source, "first_supervised", None)
    return None if fn is None else np.asarray(fn(), dtype=np.int64)


class TokenBudgetBatcher:
    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        token_budget: int,
        max_doc_tokens: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        first_supervised: np.ndarray | None = None,
    ) -> None:
        if len(lengths) == 0:
            raise ValueError("the training set has no documents")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.first_supervised = first_supervised
        self.token_budget = token_budget
        self.max_doc_tokens = max_doc_tokens
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._cache: dict[int, list[list[int]]] = {}

    def _epoch(self, epoch: int) -> list[list[int]]:
        if epoch not in self._cache:
            self._cache = {
                epoch: epoch_steps(
                    self.lengths,
                    self.token_budget,
                    self.max_doc_tokens,
                    self.seed,
                    epoch,
                    self.first_supervised,
                )
            }
        return self._cache[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        """Steps each rank takes in `epoch` (the remainder not every rank gets is dropped).

        Greedy filling depends on the order, so epochs can differ by a step or two.
        """
        n = len(self._epoch(epoch)) // self.world_size
        if n == 0:
            left_out = self.unsupervised_note()
            raise DFlashError(
                f"one epoch has {len(self._epoch(epoch))} steps, fewer than the "
                f"{self.world_size} ranks; lower data.token_budget or use more data"
                + (f" ({left_out})" if left_out else "")
            )
        return n

    @property
    def steps_per_epoch(self) -> int:
        """Steps per rank in the first epoch (the planning number)."""
        return self.steps_in_epoch(0)

    def documents(self, pos: Position) -> list[int]:
        steps = self._epoch(pos.epoch)
        return steps[pos.step * self.world_size + self.rank]

    def advance(self, pos: Position) -> Position:
        if pos.step + 1 >= self.steps_in_epoch(pos.epoch):
            return Position(pos.epoch + 1, 0)
        return Position(pos.epoch, pos.step + 1)

    def unsupervised(self) -> tuple[int, int]:
        """(documents, tokens) left out of every epoch: no supervised token after the first
        within their kept window (`max_doc_tokens`)."""
        if self.first_supervised is None:
            return 0, 0
        out = left_out(self.lengths, self.first_supervised, self.max_doc_tokens)
        return int(out.sum()), int(np.minimum(self.lengths[out], self.max_doc_tokens).sum())

    def unsupervised_note(self) -> str | None:
        """What the run says about the documents `unsupervised` counts (None: there are none)."""
        docs, tokens = self.unsupervised()
        if not docs:
            return None
        return (
            f"{docs:,} of {len(self.lengths):,} training documents ({tokens:,} tokens) supervise "
            f"nothing within their first {self.max_doc_tokens:,} tokens (data.max_doc_tokens / "
            "token_budget): left out of every epoch; raise data.max_doc_tokens to train on "
            "their answers"
        )

    def truncated(self, doc_ids: Sequence[int]) -> int:
        return int((self.lengths[list(doc_ids)] > self.max_doc_tokens).sum())
