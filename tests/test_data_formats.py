"""Readers: every format, damaged files, every reader skip reason, repairs, ids."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from test_data_support import sharegpt, write_jsonl

from dflash_trainer.data.formats import read_records
from dflash_trainer.data.jsonio import iter_json_text
from dflash_trainer.data.records import SKIP_REASONS, Conversation, ReadReport, TokenizedRow
from dflash_trainer.errors import DFlashError

GOOD = sharegpt(("human", "Hi there"), ("gpt", "Hello!"))

# One record per reader-stage reason; each must be skipped with exactly that reason.
READER_CASES = {
    "bad_schema": [
        {"conversations": "not a list"},
        {"conversations": [{"from": "human"}]},
        {"conversations": [{"from": "human", "value": 3}]},
        {"messages": [["user", "hi"]]},
        {"input_ids": [1, 2], "loss_mask": [1]},
        {"input_ids": [1, 2.5], "loss_mask": [1, 1]},
        {"something": "else"},
        42,
    ],
    "unknown_role": [
        sharegpt(("human", "hi"), ("tool", "x")),
        {"messages": [{"role": "user", "content": "q"}, {"role": "function", "content": "a"}]},
    ],
    "non_text_content": [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                {"role": "assistant", "content": "a"},
            ]
        }
    ],
    "empty_turn": [sharegpt(("human", "hi"), ("gpt", "  \n"))],
    "misplaced_system": [sharegpt(("human", "hi"), ("system", "be nice"), ("gpt", "ok"))],
    "not_alternating": [
        sharegpt(("human", "a"), ("human", "b"), ("gpt", "c")),
        sharegpt(("human", "a"), ("gpt", "b"), ("gpt", "c")),
    ],
    "no_assistant_turn": [
        sharegpt(("human", "only a question")),
        sharegpt(("system", "sys")),
        sharegpt(),
        sharegpt(("gpt", "an answer whose prompt is elsewhere")),
        {"prompt": "a prompt is not training data by itself"},
    ],
    "no_supervised_tokens": [{"input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]}],
}


def _read(path: Path, **kw: object) -> tuple[list[object], ReadReport]:
    report = ReadReport()
    return list(read_records(path, report=report, **kw)), report  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reason", "value"), [(r, v) for r, vs in READER_CASES.items() for v in vs]
)
def test_each_reader_skip_reason(tmp_path: Path, reason: str, value: object) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [GOOD, value])
    records, report = _read(path)
    assert len(records) == 1
    assert dict(report.skipped) == {reason: 1}
    assert report.records == 2 and report.kept == 1


def test_no_user_turn_only_when_reading_prompts(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}, sharegpt(("system", "s"))])
    records, report = _read(path, require_assistant=False)
    assert len(records) == 1 and dict(report.skipped) == {"no_user_turn": 1}


def test_duplicate_content_is_skipped_even_across_formats(tmp_path: Path) -> None:
    same_openai = {
        "messages": [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
        ]
    }
    path = write_jsonl(tmp_path / "in.jsonl", [GOOD, same_openai, GOOD])
    records, report = _read(path)
    assert len(records) == 1 and dict(report.skipped) == {"duplicate": 2}


def test_bad_json_lines_are_counted_with_their_bytes(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    bad = '{"conversations": [{"from": "human", "value": "unterminated'
    path.write_text(json.dumps(GOOD) + "\n" + bad + "\n" + "\n" + json.dumps(GOOD | {"id": "2"}))
    records, report = _read(path)
    assert report.skipped == {"bad_json": 1, "duplicate": 1}
    assert report.damaged_bytes == len(bad.encode()) + 1  # the line and its newline
    assert len(records) == 1


def test_json_array_recovers_after_damage_in_the_middle_and_a_truncated_tail() -> None:
    a = sharegpt(("human", "first"), ("gpt", "one"), rid="a")
    b = sharegpt(("human", "second {not json} here"), ("gpt", "two"), rid="b")
    c = sharegpt(("human", "third"), ("gpt", "three"), rid="c")
    damaged = json.dumps(b).replace('"value": "two"', '"value": two"')  # breaks b only
    text = "[\n" + ",\n".join([json.dumps(a), damaged, json.dumps(c), json.dumps(a)]) + ",\n"
    text += json.dumps(c)[:25]  # truncated mid-record, as in the ShareGPT asset
    values = list(iter_json_text(text))
    kinds = [v["id"] if isinstance(v, dict) else "BAD" for v in values]
    # The inner turn objects of b (which decode fine) must not be taken for records.
    assert kinds == ["a", "BAD", "c", "a", "BAD"]
    assert values[-1].nbytes == 25


def test_json_array_without_damage_and_trailing_garbage() -> None:
    assert list(iter_json_text('[{"text": "a"}, {"text": "b"}]')) == [{"text": "a"}, {"text": "b"}]
    vals = list(iter_json_text('[{"text": "a"}] junk'))
    assert vals[0] == {"text": "a"} and vals[1].nbytes == 4


def test_sharegpt_roles_and_repairs(tmp_path: Path) -> None:
    rec = sharegpt(
        ("system", "You are terse."),
        ("gpt", "a leftover answer"),
        ("user", "q1"),
        ("chatgpt", "a1"),
        ("Human", "q2"),
        ("bing", "a2"),
        ("human", "q3 without answer"),
        rid="x",
    )
    path = tmp_path / "data.json"
    path.write_text(json.dumps([rec]))
    (conv,), report = _read(path)
    assert isinstance(conv, Conversation) and conv.id == "x"
    assert [m["role"] for m in conv.messages] == [
        "system", "user", "assistant", "user", "assistant",
    ]  # fmt: skip
    assert report.repairs == {"leading_assistant_dropped": 1, "trailing_user_dropped": 1}
    # For regeneration the trailing user turn stays: it is a prompt to answer.
    (conv2,), _ = _read(path, require_assistant=False)
    assert conv2.messages[-1] == {"role": "user", "content": "q3 without answer"}


def test_duplicate_ids_with_different_content_are_renamed(tmp_path: Path) -> None:
    rows = [
        sharegpt(("human", "a"), ("gpt", "b"), rid="same"),
        sharegpt(("human", "c"), ("gpt", "d"), rid="same"),
        sharegpt(("human", "e"), ("gpt", "f"), rid="same"),
    ]
    records, report = _read(write_jsonl(tmp_path / "in.jsonl", rows))
    assert [r.id for r in records] == ["same", "same~2", "same~3"]  # type: ignore[attr-defined]
    assert report.repairs == {"duplicate_id_renamed": 2}


def test_openai_prompts_tokenized_and_chatterbot(tmp_path: Path) -> None:
    openai = {
        "id": 7,
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]},
            {"role": "assistant", "content": "hi"},
        ],
    }  # fmt: skip
    tokenized = {"input_ids": [3, 4, 5], "loss_mask": [0, True, 1]}
    write_jsonl(tmp_path / "a.jsonl", [openai, tokenized])
    (tmp_path / "b.yml").write_text("categories: [x]\nconversations:\n- - Hi\n  - Hello\n  - Bye\n")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"question_id": 81, "turns": ["t1", "t2"]}) + "\n" + '"bare"\n')
    records, report = _read(tmp_path, require_assistant=False)
    assert report.kept == 5 and not report.skipped
    conv, row, yaml_conv, mt, bare = records
    assert isinstance(conv, Conversation) and conv.id == "7"
    assert conv.messages[1] == {"role": "user", "content": "hello"}
    assert isinstance(row, TokenizedRow) and row.loss_mask == [False, True, True]
    assert [m["role"] for m in yaml_conv.messages] == ["user", "assistant", "user"]  # type: ignore[union-attr]
    assert mt.id == "81" and [m["content"] for m in mt.messages] == ["t1", "t2"]  # type: ignore[union-attr]
    assert bare.messages == [{"role": "user", "content": "bare"}]  # type: ignore[union-attr]


def test_forced_format_rejects_other_records(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [GOOD, {"messages": []}])
    records, report = _read(path, fmt="sharegpt")
    assert len(records) == 1 and report.skipped == {"bad_schema": 1}


def test_max_records_counts_skipped_records_too(tmp_path: Path) -> None:
    rows = [sharegpt(("human", str(i)), ("gpt", "x")) for i in range(5)]
    rows.insert(1, sharegpt(("human", "q")))
    records, report = _read(write_jsonl(tmp_path / "in.jsonl", rows), max_records=3)
    assert report.records == 3 and len(records) == 2 and report.skipped == {"no_assistant_turn": 1}


def test_hf_names_need_datasets_and_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(DFlashError, match="pip install datasets"):
        list(read_records("hf:org/some-dataset"))
    with pytest.raises(DFlashError, match="pip install datasets"):
        list(read_records("org/some-dataset"))
    with pytest.raises(DFlashError, match="does not exist"):
        list(read_records(str(tmp_path / "missing.json")))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DFlashError, match="unknown file type"):
        list(read_records(tmp_path / "x.csv"))


def test_report_round_trips_and_every_reason_is_documented() -> None:
    r = ReadReport(source="s")
    for reason in SKIP_REASONS:
        r.skip(reason)
    r.keep()
    r.reject("too_long")
    assert ReadReport.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert r.records == r.kept + sum(r.skipped.values())
    text = r.format()
    assert all(reason in text for reason in SKIP_REASONS)
