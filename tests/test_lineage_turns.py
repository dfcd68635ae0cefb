"""Freshness per (prompt id, assistant turn): a continuation may train on the later turns of a
conversation an earlier one trained on, with the earlier turns as context only, and never on a
turn the lineage records (lineage/turns.py, data/prepare.py, lineage/training.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from lineage_chain import Chain, base_config, conversation
from test_data_support import tiny_tokenizer, write_jsonl

from dflash_trainer.cli import main
from dflash_trainer.config import config_from_dict, replace
from dflash_trainer.data.prepare import read_record_ids
from dflash_trainer.data.records import content_hash
from dflash_trainer.data.shards import PreparedDataset
from dflash_trainer.errors import DFlashError
from dflash_trainer.lineage.record import (
    append,
    prompts_sha256,
    read_lineage,
    read_prompts,
    recorded_turns,
    write_lineage,
)
from dflash_trainer.lineage.turns import TurnSet
from dflash_trainer.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _talk(rid: str, users: int) -> dict[str, Any]:
    """`users` user turns, each answered."""
    msgs = []
    for k in range(1, users + 1):
        msgs.append({"role": "user", "content": f"question {k} of {rid}: how is the dog today"})
        answer = " ".join(["the quick brown fox", "jumps over", "the lazy dog"][: k % 3 + 1])
        msgs.append({"role": "assistant", "content": f"answer {k}: {answer}"})
    return {"id": rid, "messages": msgs}


def _lineage(d: Path, *records: dict[str, Any]) -> Path:
    """A drafter directory whose lineage holds one continuation per record (no weights are
    needed to read what it trained on)."""
    d.mkdir(parents=True)
    lineage, prompts = None, []
    for record in records:
        lineage, prompts = append(lineage, prompts, {"data": {}}, record)
    assert lineage is not None
    write_lineage(d, lineage, prompts)
    return d


def _prepare(src: Path, tok: Path, out: Path, *exclude: Path) -> PreparedDataset:
    argv = ["data", "prepare", "--input", str(src), "--tokenizer", str(tok), "--out", str(out)]
    argv += ["--eval-fraction", "0"]
    for d in exclude:
        argv += ["--exclude-lineage", str(d)]
    assert main(argv) == 0
    return PreparedDataset(out, "train")


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def test_prepare_keeps_later_turns_with_the_recorded_ones_as_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok)
    rows = [_talk("mix/a", 3), _talk("mix/b", 3), _talk("mix/c", 2), _talk("mix/d", 3)]
    src = write_jsonl(tmp_path / "talks.jsonl", rows)
    # a: turn 1 trained; b: every turn (1..3); c: recorded without turns (all of them);
    # d: turns 1 and 3 in two continuations (a list form and a count form).
    lin = _lineage(tmp_path / "lin", {"mix/a": 1, "mix/b": 3, "mix/c": None}, {"mix/d": [3]})
    lin2 = _lineage(tmp_path / "lin2", {"mix/d": 1})
    plain = _prepare(src, tok, tmp_path / "plain")
    fresh = _prepare(src, tok, tmp_path / "fresh", lin, lin2)
    said = capsys.readouterr().out
    assert "lineage: 2 conversations kept for their later turns, 3 recorded turns" in said
    name = {content_hash(r["messages"]): r["id"] for r in rows}  # documents are named by content
    before = {name[d.doc_id]: d for d in plain.iter_documents()}
    after = {name[d.doc_id]: d for d in fresh.iter_documents()}
    assert len(before) == 4 and sorted(after) == ["mix/a", "mix/d"]  # b, c: nothing new
    assert read_record_ids(tmp_path / "fresh") == {"mix/a": [2, 3], "mix/d": [2]}
    assert read_record_ids(tmp_path / "plain") == {"mix/a": 3, "mix/b": 3, "mix/c": 2, "mix/d": 3}
    # Same tokens; the mask is the plain one with the recorded turns' spans taken off.
    for rid, supervised in (("mix/a", (2, 3)), ("mix/d", (2,))):
        old, new = before[rid], after[rid]
        assert np.array_equal(new.input_ids, old.input_ids)
        runs = _runs(old.loss_mask)
        assert len(runs) == 3  # one supervised span per assistant turn
        want = np.zeros_like(old.loss_mask)
        for turn, (a, b) in enumerate(runs, 1):
            want[a:b] = turn in supervised
        assert np.array_equal(new.loss_mask, want), rid
        assert 0 < new.loss_mask.sum() < old.loss_mask.sum()
    manifest = json.loads((tmp_path / "fresh" / "manifest.json").read_text())
    assert manifest["read_report"]["skipped"]["in_lineage"] == 2
    assert manifest["lineage_exclusion"] == {
        "recorded_ids": 4,
        "kept_for_later_turns": 2,
        "context_turns": 3,
    }


def test_prompts_and_regenerate_keep_conversations_with_turns_left(tmp_path: Path) -> None:
    rows = [_talk(f"c{k}", users) for k, users in enumerate((2, 2, 3, 1, 3))]
    src = write_jsonl(tmp_path / "plain.jsonl", rows)
    # c0: turn 1 of 2 trained; c1: both; c2: all (null); c3: never; c4: turns 1 and 3 of 3.
    lin = _lineage(tmp_path / "lin", {"mix/c0": 1, "mix/c1": 2, "mix/c2": None, "mix/c4": [1, 3]})
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - name: mix\n    path: {src}\n    messages: messages\n")
    out = tmp_path / "prompts.jsonl"
    argv = ["data", "prompts", "--sources", str(mix), "--out", str(out)]
    assert main([*argv, "--decontam-evals", "none", "--exclude-lineage", str(lin)]) == 0
    kept = sorted(json.loads(x)["id"] for x in out.read_text().splitlines())
    assert kept == ["mix/c0", "mix/c3", "mix/c4"]
    side = json.loads(out.with_name("prompts.jsonl.sources.json").read_text())
    assert side["sources"][0]["in_lineage"] == 2 and side["sources"][0]["later_turns"] == 2
    assert side["excluded_by_lineage"]["kept_for_later_turns"] == 2
    # regenerate: the same rule on the turns it will answer (--max-turns caps them).
    from dflash_trainer.data.prompts_cli import fresh_conversations
    from dflash_trainer.data.records import Conversation

    convs = [Conversation(f"mix/{r['id']}", r["messages"]) for r in rows]
    fresh = fresh_conversations(convs, [str(lin)], None)
    assert [c.id for c in fresh] == ["mix/c0", "mix/c3", "mix/c4"]
    assert [c.id for c in fresh_conversations(convs, [str(lin)], 1)] == ["mix/c3"]
    assert [c.id for c in fresh_conversations(convs, [str(lin)], 2)] == [
        "mix/c0",
        "mix/c3",
        "mix/c4",
    ]


def test_a_lineage_in_the_count_form_reads_as_turns_one_to_n(tmp_path: Path) -> None:
    """The files as every lineage before per-turn records was written (version 1, id -> n)."""
    d = tmp_path / "old"
    d.mkdir()
    prompts = {"mix/c0": 2, "mix/c1": 1, "mix/c2": None}
    row = {"index": 0, "prompts": prompts}
    with gzip.GzipFile(d / "lineage_prompts.jsonl.gz", "wb", mtime=0) as f:
        f.write((json.dumps(row) + "\n").encode())
    ids = {"count": 3, "sha256": prompts_sha256(prompts), "file": "lineage_prompts.jsonl.gz"}
    cont = {"index": 0, "start": {"weights_sha256": None}, "data": {"prompt_ids": ids}}
    (d / "lineage.json").write_text(
        json.dumps({"format": "dflash-lineage", "version": 1, "continuations": [cont]})
    )
    recorded = recorded_turns(d)
    assert recorded.recorded("mix/c0") == TurnSet(2) and recorded.recorded("mix/c1") == TurnSet(1)
    assert recorded.recorded("mix/c2") is None  # not recorded: every turn
    assert recorded.new_turns("mix/c0", 4) == [3, 4] and recorded.new_turns("mix/c2", 9) == []
    assert read_prompts(d) == [prompts]  # read as written, hashes intact


def test_a_turn_in_two_continuations_is_refused_by_verify(tmp_path: Path) -> None:
    from dflash_trainer.lineage.cli import _no_turn_twice

    ok = [{"a": 1, "b": None}, {"a": [2, 3]}, {"a": [5], "c": 4}]
    assert _no_turn_twice(ok, tmp_path) == {"a": [0, 1, 2], "b": [0], "c": [2]}
    for bad, needle in (
        ([{"a": 2}, {"a": [2, 3]}], "assistant turn 2 of prompt 'a'"),
        ([{"a": None}, {"a": [7]}], "assistant turn 7 of prompt 'a'"),
        ([{"a": None}, {"a": None}], "every turn of prompt 'a'"),
        ([{"a": 10**30}, {"a": [7]}], "assistant turn 7 of prompt 'a'"),  # a number, not a set
        ([{"a": [3]}, {"b": 1}, {"a": 3}], "continuations 0 and 2"),
    ):
        with pytest.raises(DFlashError, match=needle):
            _no_turn_twice(bad, tmp_path)


# ------------------------------------------------------- a continuation on later turns


def _one_more_turn(i: int) -> dict[str, Any]:
    """`mix/c<i>` of the chain with a turn after those it trained on (its turn 2 or 3)."""
    row = conversation(i)
    words = [w for m in row["messages"] for w in m["content"].split()][::-1]
    row["messages"] += [
        {"role": "user", "content": "and later " + " ".join(words[:6])},
        {"role": "assistant", "content": " ".join(words[6:30])},
    ]
    return row


def test_a_continuation_trains_the_later_turns_of_earlier_conversations(
    chain: Chain, tmp_path: Path
) -> None:
    run2 = chain.runs[2]
    src = write_jsonl(tmp_path / "later.jsonl", [_one_more_turn(i) for i in range(12)])
    again = tmp_path / "again"
    _prepare(src, chain.target, again)
    later = tmp_path / "later"
    _prepare(src, chain.target, later, run2)
    assert read_record_ids(later) == {f"mix/c{i}": [3] if i % 3 == 0 else [2] for i in range(12)}
    cfg = base_config(tmp_path, chain.target, again, tmp_path / "refused")
    cfg["training"]["seed"] = 3
    cfg = config_from_dict(cfg)
    # Data that supervises every turn again: 4 conversations x 2 turns + 8 x 1 recorded.
    refused = replace(cfg, drafter={"init_from": str(run2)})
    needle = (r"12 of its 12 training prompts supervise 16 assistant turn\(s\) .*assistant "
              r"turn 1 of prompt 'mix/c0'.*--exclude-lineage")  # fmt: skip
    with pytest.raises(DFlashError, match=needle):
        Trainer(refused, log_to_console=False)
    # Data whose earlier turns are context: accepted, trained, recorded per turn.
    run3 = tmp_path / "run3"
    path = tmp_path / "run3.yaml"
    raw = base_config(tmp_path, chain.target, later, run3)
    raw["training"]["seed"] = 3
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(path), "--skip-doctor", "--init-from", str(run2)]) == 0
    lineage = read_lineage(run3)
    assert lineage is not None and lineage["version"] == 2
    assert len(lineage["continuations"]) == 4
    prompts = read_prompts(run3)
    assert prompts[3] == {f"mix/c{i}": [3] if i % 3 == 0 else [2] for i in range(12)}
    assert lineage["continuations"][3]["data"]["assistant_turns"] == 12
    assert recorded_turns(run3).recorded("mix/c0") == TurnSet(3)
    assert main(["lineage", "verify", str(run3)]) == 0
    # Nothing is left of these conversations for a fifth continuation.
    assert main(["data", "prepare", "--input", str(src), "--tokenizer", str(chain.target),
                 "--out", str(tmp_path / "none"), "--exclude-lineage", str(run3)]) == 2  # fmt: skip
