"""Prompts written by the target itself: sample user turns, filter, de-duplicate, resumably.

Why: a drafter trained on the target's answers to prompts the target itself would write sees
the target's own distribution on both sides of the turn; no external prompt set is needed.

How: the chat template is rendered up to the opening of a user turn (the template's default
system prompt, or `system`; with `topics`, item i gets the hint "The user's next message is
about <topic>." as a system line), and the target continues from there at temperature ~1
until its end of turn. Item i is sampled with its own key (seed, i): its text does not depend
on batching, on the backend's scheduling or on an interruption.

Kept prompts must be real questions: an item is dropped (and the reason counted) when it
did not end within max_new_tokens (`unfinished`), is empty, shorter than `min_chars` or
longer than `max_chars`, contains a chat-template control string, is mostly non-printable
or not letters (`non_text`), repeats itself (`repetitive`: few distinct word trigrams, or
it compresses too well), equals an earlier kept prompt after normalisation (`duplicate`) or
shares most of its word trigrams with one (`near_duplicate`: Jaccard >= a threshold, found
through MinHash bands and then checked exactly). Decisions are made in item order, so the
kept set is a function of the settings alone.

Output: `out` holds kept prompts, one OpenAI-messages record per line, read by
`dflash data regenerate` as is: {"id", "messages": [(system,) user], "synthesis": {settings,
topic, finish_reason, tokens}}. `<out>.dropped.jsonl` lists dropped ids with their reason and
`<out>.report.json` the counts. Records are appended in item order with one write each, flushed
and fsynced; a restart drops a partial last line, refuses other settings and skips the items
already decided, so an interrupted job ends with the set an uninterrupted one writes.
"""

from __future__ import annotations

import json
import re
import sys
import time
import unicodedata
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_trainer.atomic_dir import write_file_atomic
from dflash_trainer.data.append_log import append_line, complete_lines
from dflash_trainer.data.sampling import item_key
from dflash_trainer.data.template import ChatTemplate
from dflash_trainer.errors import DFlashError
from dflash_trainer.outputs import locks_output

DROP_REASONS = (
    "unfinished",
    "empty",
    "too_short",
    "too_long",
    "control_token",
    "non_text",
    "repetitive",
    "duplicate",
    "near_duplicate",
)
_SENTINEL = "\u2063SYNTHESIZED-USER-TURN\u2063"


@dataclass(frozen=True)
class SynthSettings:
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    system: str | None = None
    topics: tuple[str, ...] = ()
    enable_thinking: bool | None = None
    min_chars: int = 12
    max_chars: int = 4000
    near_duplicate: float = 0.7
    backend: str = "static"

    def check(self) -> None:
        if not 0.0 < self.near_duplicate <= 1.0:
            raise DFlashError(f"--near-duplicate {self.near_duplicate}: use a Jaccard in (0, 1]")
        if self.temperature <= 0:
            raise DFlashError("--temperature must be > 0: greedy decoding writes one prompt")
        if self.min_chars > self.max_chars:
            raise DFlashError(f"--min-chars {self.min_chars} exceeds --max-chars {self.max_chars}")


MUST_MATCH = tuple(k for k in SynthSettings.__dataclass_fields__ if k != "backend")


# --- what a kept prompt must look like


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[^\w\s]", " ", text).split())


def shingles(norm: str, n: int = 3) -> set[str]:
    words = norm.split()
    if len(words) <= n:
        return {" ".join(words)}
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def filter_reason(
    text: str, finish: str, settings: SynthSettings, control: Sequence[str]
) -> str | None:
    """Why `text` is not a usable prompt (one of DROP_REASONS), or None."""
    if finish != "stop":
        return "unfinished"
    if not text.strip():
        return "empty"
    if len(text) < settings.min_chars:
        return "too_short"
    if len(text) > settings.max_chars:
        return "too_long"
    if any(c in text for c in control):
        return "control_token"
    # U+FFFD stands for bytes that did not decode: a token split inside a character.
    ok = sum((ch.isprintable() or ch in "\n\t") and ch != "\ufffd" for ch in text)
    printable = ok / len(text)
    letters = sum(ch.isalpha() for ch in text) / len(text)
    if printable < 0.95 or letters < 0.3:
        return "non_text"
    words = normalise(text).split()
    grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    if len(grams) >= 10 and len(set(grams)) < 0.5 * len(grams):
        return "repetitive"
    raw = text.encode("utf-8")
    if len(raw) >= 200 and len(zlib.compress(raw)) < 0.2 * len(raw):
        return "repetitive"
    return None


class Deduper:
    """Exact duplicates after `normalise`, and near duplicates by word-trigram Jaccard.

    Candidates come from MinHash: `perms` hash permutations in `bands` bands; two texts that
    agree on every row of one band are compared exactly. With 64 permutations in 16 bands of
    4, a pair at Jaccard 0.7 is a candidate with probability 1 - (1 - 0.7^4)^16 > 0.99.
    """

    _PRIME = (1 << 31) - 1

    def __init__(self, threshold: float = 0.7, perms: int = 64, bands: int = 16) -> None:
        rng = np.random.default_rng(12345)  # fixed: signatures must not change between runs
        self.a = rng.integers(1, self._PRIME, perms, dtype=np.int64)
        self.b = rng.integers(0, self._PRIME, perms, dtype=np.int64)
        self.threshold, self.bands, self.rows = threshold, bands, perms // bands
        self.exact: set[str] = set()
        self.sets: list[set[str]] = []
        self.buckets: dict[tuple[int, bytes], list[int]] = {}

    def _signature(self, grams: set[str]) -> np.ndarray:
        h = (
            np.array(
                [
                    int.from_bytes(zlib.crc32(g.encode()).to_bytes(4, "little"), "little")
                    for g in grams
                ],
                dtype=np.int64,
            )
            % self._PRIME
        )
        return ((h[:, None] * self.a[None, :] + self.b[None, :]) % self._PRIME).min(axis=0)

    def _keys(self, sig: np.ndarray) -> list[tuple[int, bytes]]:
        r = self.rows
        return [(i, sig[i * r : (i + 1) * r].tobytes()) for i in range(self.bands)]

    def check(self, text: str) -> tuple[str | None, Any]:
        """(reason or None, what `add` needs to remember the text)."""
        norm = normalise(text)
        if norm in self.exact:
            return "duplicate", None
        grams = shingles(norm)
        keys = self._keys(self._signature(grams))
        seen: set[int] = set()
        for key in keys:
            for j in self.buckets.get(key, ()):
                if j in seen:
                    continue
                seen.add(j)
                other = self.sets[j]
                if len(grams & other) >= self.threshold * len(grams | other):
                    return "near_duplicate", None
        return None, (norm, grams, keys)

    def add(self, memo: Any) -> None:
        norm, grams, keys = memo
        self.exact.add(norm)
        self.sets.append(grams)
        for key in keys:
            self.buckets.setdefault(key, []).append(len(self.sets) - 1)

    def offer(self, text: str) -> str | None:
        """Check and, when new, remember `text`; the drop reason or None."""
        reason, memo = self.check(text)
        if reason is None:
            self.add(memo)
        return reason


# --- prompts and the generators


def user_turn_prefix(chat: ChatTemplate, system: str | None, topic: str | None) -> list[int]:
    """Token ids of the template rendered up to where a user message's content starts."""
    lines = [s for s in (system, topic and f"The user's next message is about {topic}.") if s]
    messages = [{"role": "system", "content": "\n".join(lines)}] if lines else []
    text = chat.render([*messages, {"role": "user", "content": _SENTINEL}])
    if _SENTINEL not in text:
        raise DFlashError("the chat template does not render a user message verbatim")
    prefix = text[: text.index(_SENTINEL)]
    return list(chat.tokenizer(prefix, add_special_tokens=False)["input_ids"])


class KeyedHFGenerator:
    """Per-item seeded HF `generate`, one prompt at a time: the fallback for targets the
    engine cannot run (each item's text still depends only on its key)."""

    def __init__(self, model: Any, settings: Any, stops: list[int], pad_id: int) -> None:
        from dflash_trainer.data.hf_generate import _hf_generation_config

        self.model = model
        self.config = _hf_generation_config(settings, stops, pad_id)

    def generate(self, prompts: list[list[int]], keys: list[int]) -> list[list[int]]:
        import torch

        outs = []
        with torch.inference_mode():
            for p, k in zip(prompts, keys):
                torch.manual_seed(k)
                ids = torch.tensor([p], dtype=torch.long, device=self.model.device)
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), generation_config=self.config
                )
                outs.append(out[0, len(p) :].tolist())
        return outs


# --- files


def _read_lines(path: Path, settings: SynthSettings) -> list[dict[str, Any]]:
    """Records of `path` (a partial last line dropped); refuses other settings."""
    if not path.exists():
        return []
    records = []
    for lineno, _offset, line in complete_lines(path):
        try:  # not JSON, not UTF-8, too deep, or not one of our records: not our file
            rec = json.loads(line)
            synth, _ = rec["synthesis"], rec["id"]
            if not isinstance(synth, dict):
                raise TypeError("`synthesis` is not an object")
        except (ValueError, RecursionError, KeyError, TypeError) as e:
            raise DFlashError(
                f"{path}: line {lineno} is not a synthesis record ({e}); move the file "
                "aside or pass another --out"
            ) from e
        for key in MUST_MATCH:
            mine = list(getattr(settings, key)) if key == "topics" else getattr(settings, key)
            if synth.get(key) != mine:
                raise DFlashError(
                    f"{path} was synthesized with {key}={synth.get(key)!r}, this job uses "
                    f"{key}={mine!r}; resume with the same settings or write to another --out"
                )
        records.append(rec)
    return records


def _append(f: Any, record: dict[str, Any]) -> None:
    append_line(f, json.dumps(record, ensure_ascii=False))


def item_id(i: int) -> str:
    return f"synth-{i:07d}"


@dataclass
class SynthReport:
    requested: int = 0
    already_done: int = 0
    kept: int = 0
    """Kept prompts in the output, this run and earlier ones."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Drop reasons over the whole output, this run and earlier ones."""
    new_tokens: int = 0
    seconds: float = 0.0
    not_answered: int = 0
    """Items a server failed to answer, left for a rerun."""
    server: dict[str, Any] | None = None
    """A server's statistics (data/openai_client.ServerStats), with --backend openai."""

    def format(self) -> str:
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        return (
            f"kept {self.kept} of {self.requested} prompts ({self.already_done} decided by an "
            f"earlier run); dropped: {why}; {self.new_tokens} new tokens in "
            f"{self.seconds:.1f} s"
            + (f"; {self.not_answered} not answered by the server" if self.not_answered else "")
        )


def _generator(
    model: Any,
    settings: SynthSettings,
    stops: list[int],
    pad_id: int,
    rows: int,
    engine: dict[str, Any] | None = None,
    server: Any = None,
    tokenizer: Any = None,
) -> Any:
    """The static engine when the target allows it (CPU too: its eager static path), else
    per-item seeded HF generate (a one-line notice says why); with backend openai, `server`
    (openai_backend.ServerOptions) on its completions endpoint."""
    from dflash_trainer.data.engine import StaticBatchEngine
    from dflash_trainer.data.settings import GenerationSettings
    from dflash_trainer.eval.static_decode import static_support

    gen = GenerationSettings(
        settings.model, settings.temperature, settings.top_p, settings.max_new_tokens,
        settings.enable_thinking, settings.backend, settings.seed,
    )  # fmt: skip
    if settings.backend == "openai":
        if server is None or server.endpoint != "completions":
            raise DFlashError(
                "synthesize continues a rendered template: --backend openai needs a server on "
                "its completions endpoint (--base-url, --endpoint completions)"
            )
        return server.generator(gen, stops, tokenizer)
    why = static_support(model) if settings.backend == "static" else "--backend hf"
    if why is None:
        return StaticBatchEngine(model, gen, stops, pad_id, rows=rows, **(engine or {}))
    print(f"dflash: synthesizing with per-prompt HF generate: {why}", file=sys.stderr)
    return KeyedHFGenerator(model, gen, stops, pad_id)


@locks_output("out_path", "dflash data synthesize", "the synthesis output")
def synthesize(
    model: Any,
    tokenizer: Any,
    out_path: str | Path,
    n: int,
    settings: SynthSettings,
    batch_size: int = 64,
    chunk: int | None = None,
    progress: bool = True,
    engine: dict[str, Any] | None = None,
    server: Any = None,
) -> SynthReport:
    """Sample `n` user prompts from `model` (items 0..n-1), appending kept ones to `out_path`.

    With backend "openai" the items are asked of `server` (openai_backend.ServerOptions);
    an item it fails to answer is left undecided for a rerun (`not_answered`), which decides
    it after the later items: near-duplicate decisions between the two can then differ from
    an uninterrupted job's."""
    from dflash_trainer.data.regenerate import cut_at_stop, stop_ids

    settings.check()
    out = Path(out_path)
    dropped_path = out.with_name(out.name + ".dropped.jsonl")
    kwargs = (
        {} if settings.enable_thinking is None else {"enable_thinking": settings.enable_thinking}
    )
    chat = ChatTemplate.probe(tokenizer, **kwargs)
    stops = stop_ids(tokenizer, chat, model)
    if not stops:
        raise DFlashError("the tokenizer declares no end-of-turn or EOS token: turns cannot end")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    done, dedupe = _decided(out, dropped_path, settings)
    report = SynthReport(requested=n, already_done=sum(item_id(i) in done for i in range(n)))
    generator = _generator(model, settings, stops, pad_id, batch_size, engine, server, tokenizer)
    topics = settings.topics or (None,)
    prefixes = {t: user_turn_prefix(chat, settings.system, t) for t in topics}
    header = asdict(settings) | {"topics": list(settings.topics)}
    pending = [i for i in range(n) if item_id(i) not in done]
    step = chunk or max(batch_size * 4, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=len(pending), unit="prompt", disable=not progress)
    with open(out, "a", encoding="utf-8") as fk, open(dropped_path, "a", encoding="utf-8") as fd:
        for c in range(0, len(pending), step):
            items = pending[c : c + step]
            item_topics = [topics[i % len(topics)] for i in items]
            outs = generator.generate(
                [prefixes[t] for t in item_topics], [item_key(settings.seed, i) for i in items]
            )
            for i, topic, new_ids in zip(items, item_topics, outs):
                if new_ids is None:  # the server failed it: a rerun asks again
                    report.not_answered += 1
                    continue
                ids, finish, used = cut_at_stop(new_ids, stops)
                report.new_tokens += used
                text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                why = filter_reason(text, finish, settings, chat.control_strings)
                why = why or dedupe.offer(text)
                synth = header | {"topic": topic, "finish_reason": finish, "tokens": used}
                if why is None:
                    head = (
                        [{"role": "system", "content": settings.system}] if settings.system else []
                    )
                    msgs = [*head, {"role": "user", "content": text}]
                    _append(fk, {"id": item_id(i), "messages": msgs, "synthesis": synth})
                else:
                    _append(fd, {"id": item_id(i), "reason": why, "text": text, "synthesis": synth})
            bar.update(len(items))
    bar.close()
    report.seconds = time.perf_counter() - t0
    served = getattr(generator, "server_stats", None)
    report.server = asdict(served) if served is not None else None
    _summarise(report, out, dropped_path, settings)
    return report


def _decided(out: Path, dropped_path: Path, settings: SynthSettings) -> tuple[set[str], Deduper]:
    """The ids earlier runs decided, and the de-duplicator in the state they left it."""
    kept = _read_lines(out, settings)
    dedupe = Deduper(settings.near_duplicate)
    for rec in kept:  # file order is item order: the same state an uninterrupted run had
        dedupe.offer(rec["messages"][-1]["content"])
    dropped = _read_lines(dropped_path, settings)
    return {r["id"] for r in kept} | {r["id"] for r in dropped}, dedupe


def _summarise(report: SynthReport, out: Path, dropped_path: Path, settings: SynthSettings) -> None:
    """Counts over the whole output (earlier runs included), also written as JSON."""
    report.kept = len(_read_lines(out, settings))
    reasons = Counter(r["reason"] for r in _read_lines(dropped_path, settings))
    report.dropped = {k: reasons[k] for k in DROP_REASONS if reasons[k]}
    data = asdict(report) | {"settings": asdict(settings) | {"topics": list(settings.topics)}}
    write_file_atomic(out.with_name(out.name + ".report.json"), json.dumps(data, indent=1) + "\n")
