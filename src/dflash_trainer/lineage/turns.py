"""Which assistant turns of each prompt a lineage has trained on: the unit of freshness.

A continuation may train on a conversation an earlier one trained on, as long as it
supervises only turns the earlier ones did not (the earlier turns are then context). So the
lineage records, per prompt id, the assistant turns (numbered from 1, in conversation order)
that were supervised, in one of three forms:

    n            turns 1..n (the form every lineage written before per-turn records uses)
    [2, 3]       exactly these turns (only written when the turns are not 1..n)
    null         not recorded: taken as every turn of the conversation

`encode` writes a set of turns in the shortest of these forms, so a continuation that
supervised every turn of its conversations writes exactly what an older tool would have.

A prompt id names the same prompt with or without a source prefix: `dflash data prompts`
writes `<source>/<id>` (`sharegpt/01j9WoA_0`), while a plain JSONL file of the same
conversations may carry the bare `01j9WoA_0`. `RecordedTurns.matches` is the one rule every
reader of a lineage applies (the trainer's refusal, `--exclude-lineage`, `dflash lineage
verify` and its summary): ids match when equal, or when one is bare (no `/`) and equals the
other's part after its first `/`. Two prefixed ids match only when equal (`asdiv/12` and
`synth/12` are two prompts), as do two bare ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

TurnsValue = int | list[int] | None
"""One prompt's turns as stored in JSON (lineage_prompts.jsonl.gz, record_ids.json.gz)."""


@dataclass(frozen=True)
class TurnSet:
    """Turns 1..`upto` and the turns in `extra` (all above `upto + 1`): the count form stays a
    number, however large a damaged or hostile file makes it."""

    upto: int = 0
    extra: frozenset[int] = frozenset()

    @classmethod
    def of(cls, upto: int, extra: Iterable[int] = ()) -> TurnSet:
        rest = {t for t in extra if t > upto}
        while upto + 1 in rest:
            upto += 1
            rest.discard(upto)
        return cls(upto, frozenset(rest))

    def __contains__(self, turn: object) -> bool:
        return isinstance(turn, int) and (1 <= turn <= self.upto or turn in self.extra)

    def __bool__(self) -> bool:
        return self.upto > 0 or bool(self.extra)

    def size(self) -> int:  # not __len__: len() refuses numbers past sys.maxsize
        return self.upto + len(self.extra)

    def first(self) -> int | None:
        return 1 if self.upto else min(self.extra, default=None)

    def union(self, other: TurnSet) -> TurnSet:
        return TurnSet.of(max(self.upto, other.upto), self.extra | other.extra)

    def intersection(self, other: TurnSet) -> TurnSet:
        upto = min(self.upto, other.upto)
        both = {t for t in self.extra if t in other} | {t for t in other.extra if t in self}
        return TurnSet.of(upto, both)

    def value(self) -> int | list[int]:
        """The stored form (only for sets a conversation can hold: a list is spelled out)."""
        return self.upto if not self.extra else [*range(1, self.upto + 1), *sorted(self.extra)]


Turns = TurnSet | None
"""One prompt's turns; None: all of them."""


def value_problem(value: Any) -> str | None:
    """What is wrong with a stored turns value, or None when it is one of the three forms."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return None if value >= 0 else f"{value} turns"
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in value)
    ):
        return None if value == sorted(set(value)) else "turns not sorted and distinct"
    return f"{value!r:.40} is not a count, a list of turn numbers or null"


def decode(value: TurnsValue) -> Turns:
    """The turns a stored value names (None: all turns)."""
    if value is None:
        return None
    if isinstance(value, int):
        return TurnSet(value)
    return TurnSet.of(0, value)


def encode(turns: Iterable[int]) -> int | list[int]:
    """The stored form of a set of turns: n for 1..n, else the sorted list."""
    return TurnSet.of(0, turns).value()


def count(value: TurnsValue) -> int:
    """How many turns a stored value names (0 for null: not recorded)."""
    if value is None:
        return 0
    return value if isinstance(value, int) else len(value)


def overlap(a: Turns, b: Turns) -> TurnSet | None:
    """The turns two records of one prompt share (empty when none); None when both are "all
    turns"."""
    if a is None and b is None:
        return None
    if a is None or b is None:
        return b if a is None else a
    return a.intersection(b)


def unprefixed(pid: str) -> str | None:
    """The part of `<source>/<id>` after the prefix when it is a bare id (no `/`), which a
    bare id may then equal; None for a bare id, or one whose rest is prefixed again."""
    _, sep, rest = pid.partition("/")
    return rest if sep and rest and "/" not in rest else None


class RecordedTurns:
    """The union of several continuations' (prompt id -> turns): what may not be trained on
    again."""

    def __init__(self, records: Iterable[Mapping[str, TurnsValue]] = ()) -> None:
        self.by_id: dict[str, Turns] = {}
        self._prefixed: dict[str, list[str]] = {}
        """Bare id -> the recorded `<source>/<id>`s it is the part after the prefix of: built
        as ids are added, so matching a bare id is one look-up, not a scan of the lineage."""
        for record in records:
            for pid, value in record.items():
                self.add(pid, decode(value))

    def add(self, pid: str, turns: Turns) -> None:
        if pid in self.by_id:
            had = self.by_id[pid]
            turns = None if had is None or turns is None else had.union(turns)
        else:
            rest = unprefixed(pid)
            if rest is not None:
                self._prefixed.setdefault(rest, []).append(pid)
        self.by_id[pid] = turns

    def matches(self, pid: str) -> list[str]:
        """The recorded ids that name the prompt `pid` names (module docstring): `pid` itself,
        the recorded `<source>/pid` of a bare `pid`, the recorded bare `x` of a `<source>/x`.
        A bare id several sources recorded (`12`: `asdiv/12`, `synth/12`) matches them all:
        which prompt it was cannot be told, so each one's turns count as trained on."""
        out = [pid] if pid in self.by_id else []
        if "/" not in pid:
            out += self._prefixed.get(pid, ())
        else:
            rest = unprefixed(pid)
            if rest is not None and rest in self.by_id:
                out.append(rest)
        return out

    def __len__(self) -> int:
        return len(self.by_id)

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def __contains__(self, pid: object) -> bool:
        return isinstance(pid, str) and bool(self.matches(pid))

    def recorded(self, pid: str) -> Turns:
        """The turns of `pid` already trained on, under every id it matches (an empty set
        when none)."""
        done = TurnSet()
        for m in self.matches(pid):
            had = self.by_id[m]
            if had is None:
                return None
            done = done.union(had)
        return done

    def new_turns(self, pid: str, turns: int) -> list[int]:
        """Of turns 1..`turns` of `pid`, those no recorded continuation trained on."""
        done = self.recorded(pid)
        if done is None:
            return []
        return [t for t in range(1, turns + 1) if t not in done]

    def repeated(self, pid: str, value: int | list[int]) -> TurnSet:
        """The turns of a stored record of `pid` (a count or a list) already trained on."""
        done = self.recorded(pid)
        mine = decode(value) or TurnSet()
        return mine if done is None else mine.intersection(done)

    def lines(self) -> list[str]:
        """Sorted `id<TAB>turns` lines: what a preparation's fingerprint hashes."""
        out = []
        for pid in sorted(self.by_id):
            t = self.by_id[pid]
            out.append(f"{pid}\t{'all' if t is None else f'{t.upto}+{sorted(t.extra)}'}")
        return out
