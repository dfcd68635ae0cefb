"""Token-budget batching: which documents each optimizer step sees.

An epoch is a seeded permutation of the documents, cut greedily into steps whose
(truncated) token total fits `token_budget`. The order is a pure function of
(seed, epoch), so a resumed run continues at exactly the same (epoch, step) with the
same documents, and with several ranks step s of the epoch goes to rank s % world:
ranks see disjoint documents. A document longer than `max_doc_tokens` is truncated,
never dropped, and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


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


def epoch_steps(
    lengths: Sequence[int] | np.ndarray,
    token_budget: int,
    max_doc_tokens: int,
    seed: int,
    epoch: int,
) -> list[list[int]]:
    """The documents of every step of one epoch (before splitting over ranks)."""
    n = len(lengths)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    clipped = np.minimum(np.asarray(lengths, dtype=np.int64), max_doc_tokens)
    steps: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order.tolist():
        t = int(clipped[i])
        if t < 2:
            continue  # a 1-token document has nothing to predict
        if cur and used + t > token_budget:
            steps.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += t
    if cur:
        steps.append(cur)
    return steps


class TokenBudgetBatcher:
    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        token_budget: int,
        max_doc_tokens: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if len(lengths) == 0:
            raise ValueError("the training set has no documents")
        self.lengths = np.asarray(lengths, dtype=np.int64)
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
                    self.lengths, self.token_budget, self.max_doc_tokens, self.seed, epoch
                )
            }
        return self._cache[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        """Steps each rank takes in `epoch` (the remainder not every rank gets is dropped).

        Greedy filling depends on the order, so epochs can differ by a step or two.
        """
        n = len(self._epoch(epoch)) // self.world_size
        if n == 0:
            raise ValueError(
                f"one epoch has {len(self._epoch(epoch))} steps, fewer than the "
                f"{self.world_size} ranks; lower data.token_budget or use more data"
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

    def truncated(self, doc_ids: Sequence[int]) -> int:
        return int((self.lengths[list(doc_ids)] > self.max_doc_tokens).sum())
