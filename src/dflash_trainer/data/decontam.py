"""Decontamination: drop training prompts that overlap an evaluation set, by three rules.

A training conversation is dropped when one of its user turns matches an evaluation text by
one of these rules, tried in this order (the first that fires is recorded):

- `ngram`: the turn shares an n-gram (13 words by default, the size of the GPT-3 overlap study)
  with an eval text. Words are `overlap_text.tokens`: lower case, punctuation stripped, and a
  run of numbers (decimal, hexadecimal) is one word `#`. An n-gram counts only when most of
  its words (7 of 13) have content (two or more characters, not `#`): a run of single letters
  and numbers is a list (`0 1 2 ... 9 a b c`), a table (`A 4.0 A- 3.7 B+ ...`) or a code idiom
  (`for i in range(1, m + 1): for j in range(1, n + 1)`) that unrelated texts share.
- `signature`: the turn contains a Python function header with the same name and parameter
  names as the entry point of a code eval task (HumanEval, or a user file whose records have
  `prompt` and `entry_point`). Only names of two or more words are used (`is_prime`,
  `greatest_common_divisor`); one-word names (`add`, `fib`, `tri`, `f`) are what any code calls
  such a function. A 9-word header is too short for the n-gram rule, yet it names the task.
- `near_duplicate`: at least 60% of an eval text's 4-word shingles are in the turn after names,
  pronouns and numbers are replaced (`near_dup.py`): a copied word problem with its names and
  numbers changed.

Assistant turns are not checked: prompts are what the target is asked, and regeneration
replaces the answers.

Evaluation texts: the prompts the project evaluates on (GSM8K test `question`, HumanEval
`prompt`, MT-Bench `turns`, read from the assets without the evaluator's added instructions,
which are the project's own words), plus any JSON/JSONL file the user names (every string of
every record, since its schema is unknown).

Speed: the eval n-grams are a hash set of word tuples, and a training text is only looked up
at positions ending a run of n words that all occur in the eval vocabulary, so the bulk of a
chat corpus costs one set lookup per word; the near-duplicate index works the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflash_trainer.data.guard import BadValue
from dflash_trainer.data.loading import resolve_source
from dflash_trainer.data.near_dup import DEFAULT_CONTAINMENT, SHINGLE, NearDupIndex
from dflash_trainer.data.overlap_text import (
    NUMBER,
    format_signature,
    name_words,
    signatures,
    tokens,
)
from dflash_trainer.data.records import SKIP_REASONS, Conversation
from dflash_trainer.data.sources import iter_values
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import check_regular

DEFAULT_NGRAM = 13
RULES = ("ngram", "signature", "near_duplicate")
BUILTIN_EVALS: dict[str, tuple[str, ...]] = {
    # eval set -> the fields of its records that the evaluator shows the model.
    "gsm8k": ("question",),
    "humaneval": ("prompt",),
    "mt-bench": ("turns",),
}
# A signature key: (function name, parameter names).
Signature = tuple[str, tuple[str, ...]]


@dataclass(frozen=True)
class Match:
    eval_id: str
    rule: str
    """One of RULES."""
    evidence: str
    """The shared n-gram, the shared signature, or the near-duplicate's containment."""
    also: tuple[str, ...] = ()
    """The other rules that match the same conversation too (`check` fills it in)."""


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


def entry_signature(prompt: str, entry_point: str) -> Signature | None:
    """The header of `entry_point` in a code task's prompt (the last one, after helpers)."""
    found = [s for s in signatures(prompt) if s[0] == entry_point]
    return found[-1] if found else None


def parse_rules(spec: str) -> tuple[str, ...]:
    rules = tuple(r.strip().replace("-", "_") for r in spec.split(",") if r.strip())
    unknown = [r for r in rules if r not in RULES]
    if unknown or not rules:
        raise DFlashError(f"--decontam-rules {spec!r}: choose from {','.join(RULES)}")
    return rules


class EvalIndex:
    """What the rules compare against: n-grams, signatures and shingles of eval texts."""

    def __init__(
        self,
        n: int = DEFAULT_NGRAM,
        rules: Iterable[str] = RULES,
        near_threshold: float = DEFAULT_CONTAINMENT,
    ) -> None:
        if n < 1:
            raise DFlashError(f"n-gram size must be >= 1, got {n}")
        self.n = n
        self.rules = parse_rules(",".join(rules))
        self._grams: dict[tuple[str, ...], str] = {}
        self._vocab: set[str] = set()
        self._signatures: dict[Signature, str] = {}
        self._near = NearDupIndex(near_threshold)
        self.texts: dict[str, int] = {}
        """Eval records indexed, per eval set (reported next to the counts)."""

    def __len__(self) -> int:
        return len(self._grams)

    def add_text(self, eval_id: str, text: str) -> None:
        if "near_duplicate" in self.rules:
            self._near.add_text(eval_id, text)
        ws = tokens(text)
        if len(ws) < self.n:
            return
        # Whether each word carries content: 2+ characters and not a number placeholder.
        content = [len(w) > 1 and w != NUMBER for w in ws]
        need = self.n // 2 + 1
        for i in range(len(ws) - self.n + 1):
            if sum(content[i : i + self.n]) >= need:
                self._grams.setdefault(tuple(ws[i : i + self.n]), eval_id)
        self._vocab.update(ws)

    def add_code_task(self, eval_id: str, prompt: str, entry_point: str) -> None:
        """The entry point's signature, when its name is specific enough (two or more words)."""
        sig = entry_signature(prompt, entry_point)
        if sig is not None and len(name_words(sig[0])) >= 2:
            self._signatures.setdefault(sig, eval_id)

    def _add_record(self, eval_id: str, record: Any, fields: Iterable[str] | None) -> None:
        if fields is None:
            for text in _strings(record):
                self.add_text(eval_id, text)
        else:
            for key in fields:
                value = record.get(key) if isinstance(record, dict) else None
                if value is None:
                    raise DFlashError(f"eval set: {eval_id} has no field {key!r}")
                for text in _strings(value):
                    self.add_text(eval_id, text)
        if isinstance(record, dict):
            prompt, entry = record.get("prompt"), record.get("entry_point")
            if isinstance(prompt, str) and isinstance(entry, str):
                self.add_code_task(eval_id, prompt, entry)

    def add_builtin(self, name: str) -> None:
        if name not in BUILTIN_EVALS:
            raise DFlashError(f"unknown eval set {name!r}; built-in sets: {list(BUILTIN_EVALS)}")
        path = resolve_source(f"asset:{name}")
        assert isinstance(path, Path)
        count = 0
        for eval_id, record in _eval_records(path, name):
            try:
                self._add_record(eval_id, record, BUILTIN_EVALS[name])
            except DFlashError as e:
                raise DFlashError(f"eval set {name} ({path}): {e}") from None
            count += 1
        self.texts[name] = count

    def add_file(self, path: str | Path) -> None:
        p = Path(path).expanduser()
        check_regular(p, "decontamination file")  # missing, a directory, a FIFO: said as such
        count = 0
        for eval_id, record in _eval_records(p, p.name):
            self._add_record(eval_id, record, None)
            count += 1
        self.texts[str(p)] = count

    def _find_ngram(self, ws: list[str]) -> Match | None:
        """The first n-gram of the words `ws` found in an eval text, or None."""
        n, vocab, grams = self.n, self._vocab, self._grams
        run = 0
        for i, w in enumerate(ws):
            run = run + 1 if w in vocab else 0
            if run >= n:
                gram = tuple(ws[i - n + 1 : i + 1])
                hit = grams.get(gram)
                if hit is not None:
                    return Match(hit, "ngram", " ".join(gram))
        return None

    def _find_signature(self, text: str) -> Match | None:
        if not self._signatures:
            return None
        for sig in signatures(text):
            hit = self._signatures.get(sig)
            if hit is not None:
                return Match(hit, "signature", format_signature(sig))
        return None

    def _find_near(self, text: str, ws: list[str]) -> Match | None:
        hit = self._near.find(text, ws)
        if hit is None:
            return None
        evidence = f"containment {hit.containment:.2f} ({hit.shared} of {hit.size} shingles)"
        return Match(hit.eval_id, "near_duplicate", evidence)

    def _order(self, rules: Iterable[str] | None) -> tuple[str, ...]:
        """`rules` (default: the index's) in RULES order."""
        chosen = set(self.rules if rules is None else parse_rules(",".join(rules)))
        return tuple(r for r in RULES if r in chosen)

    def find(self, text: str, rules: Iterable[str] | None = None) -> Match | None:
        """The first rule (in RULES order, of `rules` or the index's) matching `text`, or None."""
        ws = tokens(text)
        for rule in self._order(rules):
            if rule == "ngram":
                hit = self._find_ngram(ws)
            elif rule == "signature":
                hit = self._find_signature(text)
            else:
                hit = self._find_near(text, ws)
            if hit is not None:
                return hit
        return None

    def check(self, conv: Conversation, rules: Iterable[str] | None = None) -> Match | None:
        """The first match of a user turn of `conv` (assistant turns are not checked), with
        the later rules that match too, so that the report can say what each rule alone drops
        (only dropped conversations pay for that)."""
        users = [m["content"] for m in conv.messages if m["role"] == "user"]
        active = self._order(rules)
        for text in users:
            hit = self.find(text, active)
            if hit is not None:
                others = [r for r in active if r != hit.rule]
                also = tuple(r for r in others if any(self.find(t, [r]) for t in users))
                return replace(hit, also=also)
        return None

    def settings(self) -> dict[str, Any]:
        """What the sidecar records next to the counts."""
        self._near.freeze()
        return {
            "rules": list(self.rules),
            "ngram": self.n,
            "eval_texts": self.texts,
            "eval_ngrams": len(self),
            "eval_signatures": len(self._signatures),
            "near_duplicate": {
                "containment": self._near.threshold,
                "shingle_words": SHINGLE,
                "min_shared": self._near.min_shared,
                "eval_texts": len(self._near),
            },
        }


def build_index(
    evals: Iterable[str],
    files: Iterable[str | Path] = (),
    n: int = DEFAULT_NGRAM,
    rules: Iterable[str] = RULES,
    near_threshold: float = DEFAULT_CONTAINMENT,
) -> EvalIndex:
    """An index over the named built-in eval sets and user files."""
    index = EvalIndex(n, rules, near_threshold)
    for name in evals:
        index.add_builtin(name)
    for f in files:
        index.add_file(f)
    return index
