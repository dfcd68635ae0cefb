"""Turns trained on twice: what a record of prompts shares with the turns a lineage holds.

One account for the three places that ask, with ids matched as `RecordedTurns.matches` says
(exactly, or across a source prefix: `01j9WoA_0` is `sharegpt/01j9WoA_0`):
`dflash train --init-from` refusing data (training.check_fresh), `dflash lineage verify`
refusing a lineage in which a continuation trained again on an earlier one's turns, and the
lineage's summary (`dflash lineage show`, the model card), which then says which continuation
did so instead of claiming each trained on new turns only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dflash_trainer.lineage.turns import RecordedTurns, Turns, TurnsValue, decode, overlap


@dataclass
class _Matched:
    """The prompts matched one way (the same id, across one source prefix, ...): how many,
    and the first, as it reads in a message."""

    count: int = 0
    example: str = ""

    def add(self, example: str) -> None:
        self.count += 1
        if self.count == 1:
            self.example = example


@dataclass
class Reuse:
    """The prompts of a record (id -> turns it supervises) with a turn trained on before."""

    prompts: int = 0
    turns: int = 0
    """(prompt, assistant turn) pairs trained on before, where both sides name their turns."""
    every_turn: int = 0
    """Prompts both sides recorded without their turns: every turn shared, how many unknown."""
    exact: _Matched = field(default_factory=_Matched)
    unprefixed: dict[str, _Matched] = field(default_factory=dict)
    """Source -> bare ids of the record recorded as `<source>/<id>`."""
    prefixed: dict[str, _Matched] = field(default_factory=dict)
    """Source -> `<source>/<id>`s of the record recorded as the bare `<id>`."""
    ambiguous: _Matched = field(default_factory=_Matched)
    """Bare ids recorded under several sources."""

    def __bool__(self) -> bool:
        return self.prompts > 0

    def add(self, pid: str, matched: list[str], shared: Turns) -> None:
        self.prompts += 1
        if shared is None:
            self.every_turn += 1
        else:
            self.turns += shared.size()
        if pid in matched:
            which = "every turn" if shared is None else f"assistant turn {shared.first()}"
            self.exact.add(f"{which} of prompt {pid!r}")
            return
        alias = f"{pid} = {', '.join(matched)}"
        if len(matched) > 1:
            self.ambiguous.add(alias)
        elif "/" in pid:
            self.prefixed.setdefault(pid.partition("/")[0], _Matched()).add(alias)
        else:
            self.unprefixed.setdefault(matched[0].partition("/")[0], _Matched()).add(alias)

    def turns_text(self) -> str:
        """'N assistant turn(s)': a prompt both sides recorded without its turns counts as
        one, so the number is then a floor."""
        n = self.turns + self.every_turn
        return f"{'at least ' if self.every_turn else ''}{n:,} assistant turn(s)"

    def amount(self) -> str:
        """'N assistant turn(s) of P prompt(s)'."""
        text = f"{self.turns_text()} of {self.prompts:,} prompt(s)"
        if self.every_turn:
            text += (f" ({self.every_turn:,} of them recorded without their turns on both "
                     "sides: every turn, counted as one)")  # fmt: skip
        return text

    def across_prefix(self) -> bool:
        return bool(self.unprefixed or self.prefixed or self.ambiguous.count)

    def details(self) -> str:
        """How the prompts matched, one clause per way, each with its first example."""
        out = []
        if self.exact.count:
            out.append(f"{self.exact.count:,} under the very ids recorded, e.g. "
                       f"{self.exact.example}")  # fmt: skip
        for src, m in sorted(self.unprefixed.items()):
            out.append(f"{m.count:,} of its prompt ids are, without their source prefix, ids "
                       f"recorded as {src}/... (e.g. {m.example})")  # fmt: skip
        for src, m in sorted(self.prefixed.items()):
            out.append(f"{m.count:,} of its prompt ids are {src}/... ids recorded without that "
                       f"source prefix (e.g. {m.example})")  # fmt: skip
        if self.ambiguous.count:
            out.append(
                f"{self.ambiguous.count:,} of its prompt ids are bare ids recorded under several "
                f"sources (e.g. {self.ambiguous.example}): which prompt each one was cannot be "
                "told, so the turns of all of them count as trained on, the safe side"
            )
        return "; ".join(out)


def find_reuse(recorded: RecordedTurns, record: Mapping[str, TurnsValue]) -> Reuse:
    """The prompts of `record` (id -> the turns it supervises; null: all) with a turn that
    `recorded` holds under an id matching theirs."""
    out = Reuse()
    for pid in sorted(record):  # sorted: the same examples whatever order the ids came in
        matched = recorded.matches(pid)
        if matched:
            shared = overlap(recorded.recorded(pid), decode(record[pid]))
            if shared is None or shared:
                out.add(pid, matched, shared)
    return out


@dataclass(frozen=True)
class Retrained:
    """A continuation that trained on turns an earlier one of its lineage had trained on."""

    later: int
    earlier: int
    reuse: Reuse

    def text(self) -> str:
        return (
            f"continuation {self.later} trained again on {self.reuse.amount()} that "
            f"continuation {self.earlier} had trained on ({self.reuse.details()})"
        )

    def pair_text(self) -> str:
        """The same, as `dflash lineage verify` names the pair."""
        return (
            f"continuations {self.earlier} and {self.later} both trained on "
            f"{self.reuse.amount()} ({self.reuse.details()})"
        )


def retrained(prompts: Sequence[Mapping[str, TurnsValue]]) -> list[Retrained]:
    """Every (later, earlier) pair of a lineage's continuations (each one's {prompt id:
    turns}) in which the later trained on turns of the earlier, in order. Each id is looked up
    once against all earlier continuations together; only the ids found there are looked up
    in each of them, so a lineage of many continuations stays linear in its ids."""
    each = [RecordedTurns([p]) for p in prompts]
    before = RecordedTurns()
    out = []
    for i, p in enumerate(prompts):
        found = {pid: value for pid, value in p.items() if pid in before}
        for j in range(i):
            reuse = find_reuse(each[j], found)
            if reuse:
                out.append(Retrained(i, j, reuse))
        for pid, value in p.items():
            before.add(pid, decode(value))
    return out
