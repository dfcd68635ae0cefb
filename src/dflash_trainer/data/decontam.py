"""Decontamination: drop training prompts that share a word n-gram with an evaluation set.

Words: the text in lower case, every run of non-alphanumeric characters (punctuation,
underscores, whitespace) turned into one space, split on spaces. A training conversation is
dropped when any of its user turns contains an n-gram (13 words by default, the size used for
the GPT-3 overlap study) of an evaluation text; the dropped id, the eval id and the n-gram are
logged. Assistant turns are not checked: prompts are what the target is asked, and
regeneration replaces the answers.

Evaluation texts: the prompts the project evaluates on (GSM8K test `question`, HumanEval
`prompt`, MT-Bench `turns`, read from the assets without the evaluator's added instructions,
which are the project's own words), plus any JSON/JSONL file the user names (every string of
every record, since its schema is unknown).

Speed: the eval n-grams are a hash set of word tuples, and a training text is only looked up
at positions ending a run of n words that all occur in the eval vocabulary, so the bulk of a
chat corpus costs one set lookup per word.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trainer.data.guard import BadValue
from dflash_trainer.data.loading import resolve_source
from dflash_trainer.data.records import SKIP_REASONS, Conversation
from dflash_trainer.data.sources import iter_values
from dflash_trainer.errors import DFlashError

DEFAULT_NGRAM = 13
BUILTIN_EVALS: dict[str, tuple[str, ...]] = {
    # eval set -> the fields of its records that the evaluator shows the model.
    "gsm8k": ("question",),
    "humaneval": ("prompt",),
    "mt-bench": ("turns",),
}
_NON_WORD = re.compile(r"[\W_]+")


def words(text: str) -> list[str]:
    return _NON_WORD.sub(" ", text.lower()).split()


@dataclass(frozen=True)
class Match:
    eval_id: str
    ngram: str


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a JSON value, in order (n-grams never span two strings).

    A stack, not recursion: a value nested as deep as the JSON decoder allows is still walked.
    """
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, list):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))


def _eval_records(path: Path, label: str) -> Iterator[tuple[str, Any]]:
    for key, value in iter_values(path):
        if isinstance(value, BadValue):
            # A record we cannot read is one we cannot protect: refuse rather than under-check.
            why = "is not valid JSON" if value.reason == "bad_json" else "cannot be read"
            raise DFlashError(
                f"eval file {path}: record {key} {why} ({value.reason}: "
                f"{SKIP_REASONS[value.reason]}); fix the file"
            )
        rid = key
        if isinstance(value, dict):
            for k in ("id", "question_id", "task_id"):
                if isinstance(value.get(k), str | int):
                    rid = str(value[k])
                    break
        yield f"{label}/{rid}", value


class EvalIndex:
    """The n-grams of evaluation texts, each mapped to the first eval id that has it."""

    def __init__(self, n: int = DEFAULT_NGRAM) -> None:
        if n < 1:
            raise DFlashError(f"n-gram size must be >= 1, got {n}")
        self.n = n
        self._grams: dict[tuple[str, ...], str] = {}
        self._vocab: set[str] = set()
        self.texts: dict[str, int] = {}
        """Eval texts indexed, per eval set (reported next to the counts)."""

    def __len__(self) -> int:
        return len(self._grams)

    def add_text(self, eval_id: str, text: str) -> None:
        ws = words(text)
        if len(ws) < self.n:
            return
        for i in range(len(ws) - self.n + 1):
            self._grams.setdefault(tuple(ws[i : i + self.n]), eval_id)
        self._vocab.update(ws)

    def add_builtin(self, name: str) -> None:
        if name not in BUILTIN_EVALS:
            raise DFlashError(f"unknown eval set {name!r}; built-in sets: {list(BUILTIN_EVALS)}")
        path = resolve_source(f"asset:{name}")
        assert isinstance(path, Path)
        count = 0
        for eval_id, record in _eval_records(path, name):
            for key in BUILTIN_EVALS[name]:
                value = record.get(key) if isinstance(record, dict) else None
                if value is None:
                    raise DFlashError(f"eval set {name} ({path}): {eval_id} has no field {key!r}")
                for text in _strings(value):
                    self.add_text(eval_id, text)
            count += 1
        self.texts[name] = count

    def add_file(self, path: str | Path) -> None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise DFlashError(f"decontamination file {p} does not exist")
        count = 0
        for eval_id, record in _eval_records(p, p.name):
            for text in _strings(record):
                self.add_text(eval_id, text)
            count += 1
        self.texts[str(p)] = count

    def find(self, text: str) -> Match | None:
        """The first n-gram of `text` found in an eval text, or None."""
        ws = words(text)
        n, vocab, grams = self.n, self._vocab, self._grams
        run = 0
        for i, w in enumerate(ws):
            run = run + 1 if w in vocab else 0
            if run >= n:
                gram = tuple(ws[i - n + 1 : i + 1])
                hit = grams.get(gram)
                if hit is not None:
                    return Match(hit, " ".join(gram))
        return None

    def check(self, conv: Conversation) -> Match | None:
        for m in conv.messages:
            if m["role"] == "user":
                hit = self.find(m["content"])
                if hit is not None:
                    return hit
        return None


def build_index(
    evals: Iterable[str], files: Iterable[str | Path] = (), n: int = DEFAULT_NGRAM
) -> EvalIndex:
    """An index over the named built-in eval sets and user files."""
    index = EvalIndex(n)
    for name in evals:
        index.add_builtin(name)
    for f in files:
        index.add_file(f)
    return index
