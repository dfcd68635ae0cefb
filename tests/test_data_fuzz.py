"""Property-based fuzzing of the data readers and `prepare_dataset`.

Inputs: a small real file (sharegpt, openai, prompt and pre-tokenized records with non-ASCII
text) cut at every byte offset, as JSON Lines and as a JSON array, plain and gzipped; random
bytes under every supported suffix; generated records whose fields have wrong types, lone
surrogates, deep nesting or numbers `json` refuses, in several encodings (UTF-8 with and without
a byte-order mark, UTF-16, Latin-1, cp1252), with or without a cut, a flipped or an inserted
byte.

The rule, for every input and every reader (`read_records` for training and for prompts,
`read_source` with and without a field mapping, decontamination's `EvalIndex.add_file`, and
`prepare_dataset` with a tiny real tokenizer): it succeeds, with every record counted
(`records == kept + sum(skipped)`, and no `record_error`, which would mean an exception no
rule classified), or it raises a DFlashError whose message names the file. Any other
exception, or an input that takes more than a few seconds, fails the test.

Examples are derandomized so CI sees the same ones; the counts are printed at the end of the
module and written to <pytest basetemp>/data_fuzz_counts.json.
"""

from __future__ import annotations

import gzip
import itertools
import json
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import FUZZ, SECONDS_PER_EXAMPLE, show, time_limit
from hypothesis import given, settings
from hypothesis import strategies as st
from test_data_support import tiny_tokenizer

from dflash_trainer.config import SourceConfig
from dflash_trainer.data.decontam import EvalIndex
from dflash_trainer.data.formats import read_records
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.records import ReadReport
from dflash_trainer.data.sources import SourceReport, read_source
from dflash_trainer.errors import DFlashError

COUNTS: Counter[str] = Counter()
SKIPS: Counter[str] = Counter()
SUFFIXES = [".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson", ".yml"]

# The small real file: one record of each format, non-ASCII text, an id, a system turn.
SMALL = [
    {
        "id": "sg1",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Ünïcödé ✓ — “quotes” 😀?"},
            {"from": "gpt", "value": "Très bien, merci."},
        ],
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
            {"role": "assistant", "content": "4"},
        ]
    },
    {"prompt": "Write a haiku."},
    {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
    {"id": 7, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
]


# ---------------------------------------------------------------- the rule


@pytest.fixture(scope="module", autouse=True)
def report_counts(request: pytest.FixtureRequest, tmp_path_factory: Any) -> Iterator[None]:
    yield
    out = tmp_path_factory.getbasetemp() / "data_fuzz_counts.json"
    counts = {k: COUNTS[k] for k in ("generated", "accepted", "rejected", "tracebacks")}
    counts |= {k: v for k, v in sorted(COUNTS.items()) if k.startswith("prepare_")}
    out.write_text(json.dumps({"counts": counts, "skipped": dict(SKIPS.most_common())}, indent=1))
    show(request, f"data fuzz: {json.dumps(counts)}; skip reasons seen: "
                  f"{dict(SKIPS.most_common())} ({out})")  # fmt: skip


def _counted(report: ReadReport | SourceReport) -> None:
    assert report.records == report.kept + sum(report.skipped.values()), report
    assert not report.errors, f"unclassified exceptions: {dict(report.errors)}"
    SKIPS.update(report.skipped)


def judge(path: Path, read: Callable[[], Any], kind: str = "") -> None:
    """Run one reader on `path`; classify the outcome (see the module docstring)."""
    COUNTS["generated"] += 1
    rejected: DFlashError | None = None
    try:
        with time_limit(SECONDS_PER_EXAMPLE, "input"):
            read()
    except DFlashError as e:
        rejected = e
    except Exception:
        COUNTS["tracebacks"] += 1
        raise
    outcome = "accepted" if rejected is None else "rejected"
    if rejected is not None:
        assert path.name in str(rejected), f"rejected without naming {path.name}: {rejected}"
    COUNTS[outcome] += 1
    if kind:
        COUNTS[kind + outcome] += 1


def _records(path: Path, require_assistant: bool) -> None:
    report = ReadReport(source=str(path))
    kept = list(read_records(path, "auto", report, require_assistant))
    assert len(kept) == report.kept
    _counted(report)


def _source(path: Path, **mapping: str) -> None:
    convs, report = read_source(SourceConfig(name="f", path=str(path), **mapping))
    assert len(convs) == report.kept
    _counted(report)


def readers(path: Path) -> list[Callable[[], None]]:
    return [
        lambda: _records(path, True),
        lambda: _records(path, False),
        lambda: _source(path),
        lambda: _source(path, messages="conversations"),
        lambda: EvalIndex().add_file(path),
    ]


def judge_all(path: Path) -> None:
    for read in readers(path):
        judge(path, read)


def judge_prepare(path: Path, work: Path) -> None:
    out = work / "prepared"

    def prepare() -> None:
        prepare_dataset(path, tiny_tokenizer(), out, overwrite=True, eval_fraction=0.2)
        from dflash_trainer.data.shards import read_manifest

        m = read_manifest(out)
        _counted(ReadReport.from_dict(m["read_report"]))

    try:
        judge(path, prepare, "prepare_")
        # Written whole or not at all: no temporary directory is ever left behind.
        assert not [p for p in work.iterdir() if p.name.startswith(".prepared.")]
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


_names = itertools.count()


def write(work: Path, data: bytes, suffix: str, compress: bool = True) -> Path:
    """`data` as a file with `suffix` (compressed for .gz unless `data` is already gzip, or
    `compress` is false: then a .gz file holds bytes that are not gzip)."""
    path = work / f"in{next(_names) % 50}{suffix}"  # a few names, reused: files stay few
    if compress and suffix.endswith(".gz") and not data.startswith(b"\x1f\x8b"):
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------- truncations of a real file


def _small(container: str) -> bytes:
    if container == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in SMALL).encode()
    return json.dumps(SMALL, ensure_ascii=False, indent=1).encode()


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".jsonl.gz", ".json.gz"])
def test_a_real_file_cut_at_every_offset(work: Path, suffix: str) -> None:
    whole = _small("jsonl" if ".jsonl" in suffix else "json")
    if suffix.endswith(".gz"):
        whole = gzip.compress(whole, mtime=0)
    for cut in range(len(whole) + 1):
        path = work / f"cut{suffix}"
        path.write_bytes(whole[:cut])
        for read in readers(path)[:4]:  # decontamination refuses damage; judged below
            judge(path, read)
        if cut % 37 == 0 or cut == len(whole):
            judge(path, readers(path)[4])
            judge_prepare(path, work)


# ---------------------------------------------------------------- random bytes


@FUZZ
@given(data=st.binary(max_size=400), suffix=st.sampled_from(SUFFIXES), compress=st.booleans())
def test_random_bytes(work: Path, data: bytes, suffix: str, compress: bool) -> None:
    judge_all(write(work, data, suffix, compress))


# ---------------------------------------------------------------- generated records

WRONG = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6)
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["hi", "answer", "  ", "", "lone \ud800", "x\udc80y", "<|im_end|>", "é✓😀"]),
)


def _or_wrong(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(good, good, good, good, WRONG)


ROLE = st.sampled_from(["human", "gpt", "system", "user", "assistant", "GPT", "tool", "model"])
SHAREGPT = st.fixed_dictionaries(
    {"conversations": _or_wrong(st.lists(st.fixed_dictionaries(
        {"from": _or_wrong(ROLE), "value": _or_wrong(TEXT)}), max_size=4))},
    optional={"id": _or_wrong(st.one_of(TEXT, st.integers()))},
)  # fmt: skip
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT})
OPENAI = st.fixed_dictionaries(
    {"messages": _or_wrong(st.lists(st.fixed_dictionaries(
        {"role": _or_wrong(ROLE), "content": _or_wrong(st.one_of(TEXT, st.lists(PART, max_size=2)))}
    ), max_size=4))}
)  # fmt: skip
PROMPT = st.one_of(
    st.sampled_from(["prompt", "text", "question"]).flatmap(
        lambda key: st.fixed_dictionaries({key: _or_wrong(TEXT)})
    ),
    st.fixed_dictionaries({"turns": _or_wrong(st.lists(TEXT, max_size=3))}),
    TEXT,
)
TOKENIZED = st.fixed_dictionaries(
    {
        "input_ids": _or_wrong(st.lists(st.integers(-3, 2**40), max_size=5)),
        "loss_mask": _or_wrong(st.lists(st.integers(0, 2), max_size=5)),
    }
)
WORDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(str.strip)
VALID = st.builds(
    lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]},
    WORDS,
    WORDS,
)  # usable records, so that prepare gets past the reader and writes shards
RECORD = st.one_of(VALID, VALID, SHAREGPT, SHAREGPT, OPENAI, PROMPT, TOKENIZED, WRONG)
RAW_LINE = st.one_of(
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 3000).map(lambda n: '{"conversations": ' + "[" * n),
    st.integers(1, 2000).map(lambda n: '{"prompt": ' + '{"a": ' * n + "1" + "}" * n + "}"),
    st.just('{"input_ids": [' + "7" * 5000 + '], "loss_mask": [1]}'),
    st.text(max_size=30),
)
LINE = st.one_of(*[RECORD.map(json.dumps)] * 5, RAW_LINE)
ENCODINGS = ["utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "latin-1", "cp1252"]


@st.composite
def files(draw: st.DrawFn) -> tuple[bytes, str]:
    """(bytes, suffix): generated records in a container, an encoding, maybe damaged."""
    lines = draw(st.lists(LINE, max_size=6))
    suffix = draw(st.sampled_from(SUFFIXES[:5]))
    text = "\n".join(lines) + "\n" if "jsonl" in suffix else "[" + ", ".join(lines) + "]"
    codec = draw(st.sampled_from(ENCODINGS))
    data = text.encode(codec, errors="surrogatepass" if codec.startswith("utf") else "replace")
    if suffix.endswith(".gz") and draw(st.booleans()):
        data = gzip.compress(data, mtime=0)  # damage below hits the compressed stream
    damage = draw(st.sampled_from(["none", "none", "cut", "flip", "insert"]))
    if data and damage != "none":
        at = draw(st.integers(0, len(data) - 1))
        if damage == "cut":
            data = data[:at]
        elif damage == "flip":
            data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
        else:
            data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    return data, suffix


@settings(FUZZ, max_examples=800)
@given(files())
def test_generated_records_in_any_encoding_and_damage(work: Path, file: tuple[bytes, str]) -> None:
    judge_all(write(work, *file))


@settings(FUZZ, max_examples=100)
@given(files())
def test_prepare_on_generated_files(work: Path, file: tuple[bytes, str]) -> None:
    judge_prepare(write(work, *file), work)
