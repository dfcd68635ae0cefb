"""Prompt ids across a source prefix: `01j9WoA_0` in a plain file is the prompt a lineage
recorded as `sharegpt/01j9WoA_0` (lineage/turns.py `RecordedTurns.matches`). The trainer's
refusal, `--exclude-lineage`, `dflash lineage verify` and the lineage summary (show, the
model card) all match ids that way (lineage/reuse.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import make_spec
from test_data_support import tiny_tokenizer, write_jsonl

from dflash_trainer.cli import main
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.data.prepare import read_record_ids
from dflash_trainer.data.prompts_cli import fresh_conversations
from dflash_trainer.data.records import Conversation
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.drafter_io import save_drafter_files
from dflash_trainer.lineage.cli import drafter_weights_sha256
from dflash_trainer.lineage.record import append, read_prompts, write_lineage
from dflash_trainer.lineage.reuse import retrained
from dflash_trainer.lineage.training import Inheritance, check_fresh
from dflash_trainer.lineage.turns import RecordedTurns, TurnSet

pytestmark = pytest.mark.usefixtures("one_thread")


def _talk(rid: str, users: int) -> dict[str, Any]:
    """`users` user turns, each answered."""
    msgs = []
    for k in range(1, users + 1):
        msgs.append({"role": "user", "content": f"question {k} of {rid}: how is the dog today"})
        msgs.append({"role": "assistant", "content": f"answer {k}: the quick brown fox jumps"})
    return {"id": rid, "messages": msgs}


def _lineage(d: Path, *records: dict[str, Any], weights: str | None = None) -> Path:
    """A drafter directory whose lineage holds one continuation per record; with `weights`,
    each continuation starts from and ends with those weights (a chain `verify` accepts)."""
    d.mkdir(parents=True, exist_ok=True)
    lineage, prompts = None, []
    for i, record in enumerate(records):
        start = {"weights_sha256": weights if i else None}
        c = {"start": start, "data": {}, "result": {"weights_sha256": weights}}
        lineage, prompts = append(lineage, prompts, c, record)
    assert lineage is not None
    write_lineage(d, lineage, prompts)
    return d


def _drafter(d: Path, *records: dict[str, Any]) -> Path:
    """A real (tiny, untrained) drafter with a lineage of `records` that describes it."""
    spec = make_spec(hidden=32, vocab=61, layers=1, heads=2, kv_heads=1, head_dim=16)
    save_drafter_files(d, spec, DFlashDrafter(spec).state_dict())
    return _lineage(d, *records, weights=drafter_weights_sha256(d))


def test_ids_match_across_a_source_prefix_and_only_there() -> None:
    rec = RecordedTurns(
        [{"sharegpt/a_0": 2, "asdiv/12": 1, "b": 1, "x/y/z": None}, {"synth/12": [2]}]
    )
    assert rec.matches("a_0") == ["sharegpt/a_0"] and rec.recorded("a_0") == TurnSet(2)
    assert rec.new_turns("a_0", 3) == [3] and "a_0" in rec
    assert rec.matches("sharegpt/b") == ["b"]  # the other way round: a bare id recorded
    # Two prefixed ids, or two bare ones, are one prompt only when equal.
    assert rec.matches("asdiv/12") == ["asdiv/12"] and rec.recorded("asdiv/12") == TurnSet(1)
    assert rec.matches("other/a_0") == [] and "other/a_0" not in rec
    assert rec.matches("a_1") == [] and rec.matches("c") == [] and rec.recorded("c") == TurnSet()
    assert rec.matches("y/z") == [] and rec.matches("z") == []  # only the first `/` splits
    # A bare id two sources recorded may have been either: both count (the safe side).
    assert rec.matches("12") == ["asdiv/12", "synth/12"] and rec.recorded("12") == TurnSet(2)
    assert rec.new_turns("12", 3) == [3]
    assert len(rec) == 5  # the recorded ids, however many a data id matches


def test_train_refuses_and_prepare_excludes_ids_recorded_with_a_source_prefix(
    tmp_path: Path,
) -> None:
    tok = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok)
    lin = _lineage(
        tmp_path / "lin",
        {"sharegpt/a_0": 1, "sharegpt/a_1": 1, "asdiv/12": 1, "synth/12": 1, "c_0": 1},
    )
    rows = [_talk("a_0", 1), _talk("a_1", 2), _talk("a_2", 1), _talk("12", 1)]
    rows += [_talk("gsm8k/12", 1), _talk("sharegpt/c_0", 1), _talk("c_1", 1)]
    src = write_jsonl(tmp_path / "regenerated.jsonl", rows)
    base = ["data", "prepare", "--input", str(src), "--tokenizer", str(tok)]
    assert main([*base, "--out", str(tmp_path / "plain"), "--eval-fraction", "0"]) == 0
    inherited = Inheritance(str(lin), prompts=read_prompts(lin))
    with pytest.raises(DFlashError) as e:
        check_fresh(inherited, tmp_path / "plain")
    said = str(e.value)
    assert "4 of its 7 training prompts supervise 4 assistant turn(s)" in said
    assert "2 of its prompt ids are, without their source prefix, ids recorded as sharegpt/" in said
    assert "(e.g. a_0 = sharegpt/a_0)" in said
    assert "1 of its prompt ids are sharegpt/... ids recorded without that source prefix " in said
    assert "(e.g. sharegpt/c_0 = c_0)" in said
    assert "bare ids recorded under several sources (e.g. 12 = asdiv/12, synth/12)" in said
    assert "the safe side" in said and "gsm8k/12" not in said and "c_1" not in said
    assert f"--exclude-lineage {lin}" in said and "source-prefixed ids" in said
    # --exclude-lineage drops the same turns: a_1 keeps its second turn, the rest stay.
    excluded = tmp_path / "excluded"
    assert main([*base, "--out", str(excluded), "--eval-fraction", "0", "--exclude-lineage",
                 str(lin)]) == 0  # fmt: skip
    assert read_record_ids(excluded) == {"a_1": [2], "a_2": 1, "gsm8k/12": 1, "c_1": 1}
    check_fresh(inherited, excluded)  # accepted


def test_prompts_and_regenerate_drop_ids_recorded_across_a_prefix(tmp_path: Path) -> None:
    # Recorded from a plain file (bare ids); `dflash data prompts` names them `mix/<id>`.
    lin = _lineage(tmp_path / "lin", {"c0": 1, "c1": 2, "mix/c9": 1})
    rows = [_talk(f"c{k}", 2) for k in range(3)]
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - name: mix\n    path: {write_jsonl(tmp_path / 'p.jsonl', rows)}"
                   "\n    messages: messages\n")  # fmt: skip
    out = tmp_path / "prompts.jsonl"
    argv = ["data", "prompts", "--sources", str(mix), "--out", str(out)]
    assert main([*argv, "--decontam-evals", "none", "--exclude-lineage", str(lin)]) == 0
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == ["mix/c0", "mix/c2"]
    side = json.loads(out.with_name("prompts.jsonl.sources.json").read_text())
    assert side["sources"][0]["in_lineage"] == 1 and side["sources"][0]["later_turns"] == 1
    # regenerate of bare ids against `mix/c9` recorded: c9 is left out, other/c9 is not.
    convs = [Conversation(rid, _talk(rid, 1)["messages"]) for rid in ("c9", "other/c9", "c1")]
    assert [c.id for c in fresh_conversations(convs, [str(lin)], None)] == ["other/c9"]


def test_retrained_counts_each_pair_of_continuations() -> None:
    prompts = [
        {"sharegpt/a_0": 1, "sharegpt/a_1": 2, "asdiv/12": 1, "b": None},
        {"a_0": 1, "a_1": [3], "synth/12": 1, "b": None},  # a_1's turn 3 and synth/12 are new
        {"sharegpt/a_0": [2], "a_1": [1, 3]},
    ]
    again = retrained(prompts)
    pairs = [(r.later, r.earlier, r.reuse.prompts) for r in again]
    assert pairs == [(1, 0, 2), (2, 0, 1), (2, 1, 1)]
    assert again[0].text() == (
        "continuation 1 trained again on at least 2 assistant turn(s) of 2 prompt(s) (1 of "
        "them recorded without their turns on both sides: every turn, counted as one) that "
        "continuation 0 had trained on (1 under the very ids recorded, e.g. every turn of "
        "prompt 'b'; 1 of its prompt ids are, without their source prefix, ids recorded as "
        "sharegpt/... (e.g. a_0 = sharegpt/a_0))"
    )
    assert "a_1 = sharegpt/a_1" in again[1].text() and "'a_1'" in again[2].text()
    assert retrained([{"asdiv/12": 1}, {"synth/12": 1}, {"b_0": 1}, {"b_1": 1}]) == []


def _card(export: Path) -> str:
    return (export / "README.md").read_text()


def test_show_verify_and_card_tell_of_turns_trained_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _drafter(tmp_path / "d", {"sharegpt/a_0": 1, "sharegpt/a_1": 1}, {"a_0": 1, "a_9": 1})
    line = ("continuation 1 trained again on 1 assistant turn(s) of 1 prompt(s) that "
            "continuation 0 had trained on (1 of its prompt ids are, without their source "
            "prefix, ids recorded as sharegpt/... (e.g. a_0 = sharegpt/a_0))")  # fmt: skip
    capsys.readouterr()
    assert main(["lineage", "show", str(d)]) == 0
    shown = capsys.readouterr().out
    assert line in shown and "no earlier one trained on" not in shown
    assert main(["lineage", "show", str(d), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)["retrained"]
    assert [(r["later"], r["earlier"], r["prompts"], r["turns"]) for r in again] == [(1, 0, 1, 1)]
    assert main(["lineage", "verify", str(d)]) != 0
    err = capsys.readouterr().err
    assert "continuations 0 and 1 both trained on 1 assistant turn(s) of 1 prompt(s)" in err
    assert "(e.g. a_0 = sharegpt/a_0)" in err
    assert main(["export", str(d), "--to", "zlab", str(tmp_path / "export")]) == 0
    card = _card(tmp_path / "export")
    assert line in card and "no earlier one trained on" not in card
    # The same lineage with fresh ids: verified, and the card says no turn came twice.
    ok = _drafter(tmp_path / "ok", {"sharegpt/a_0": 1}, {"a_1": 1, "synth/a_0": 1})
    assert main(["lineage", "verify", str(ok)]) == 0
    assert main(["export", str(ok), "--to", "zlab", str(tmp_path / "ok-export")]) == 0
    card = _card(tmp_path / "ok-export")
    assert "(each continuation on assistant turns no earlier one trained on;" in card
    assert "trained again" not in card


def test_verify_last_binds_only_the_newest_continuation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A history that already re-trained turns cannot be changed; `verify --last` still
    refuses a new continuation that does it again, and prints the recorded reuse."""
    history = ({"sharegpt/a_0": 1}, {"a_0": 1})
    d = _drafter(tmp_path / "d", *history, {"b_0": 1})
    capsys.readouterr()
    assert main(["lineage", "verify", str(d)]) != 0
    assert main(["lineage", "verify", str(d), "--last"]) == 0
    err = capsys.readouterr().err
    assert "recorded earlier: continuations 0 and 1 both trained on 1 assistant turn(s)" in err
    again = _drafter(tmp_path / "again", *history, {"sharegpt/a_0": 1})
    assert main(["lineage", "verify", str(again), "--last"]) != 0
    err = capsys.readouterr().err
    assert "continuations 0 and 2 both trained on" in err
    assert "recorded earlier: continuations 0 and 1" in err


def test_show_reads_a_lineage_whose_prompt_ids_are_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _lineage(tmp_path / "d", {"sharegpt/a_0": 1}, {"a_1": 1})
    with gzip.open(d / "lineage_prompts.jsonl.gz", "wt") as f:
        f.write(json.dumps({"index": 0, "prompts": {"sharegpt/a_0": 1}}) + "\n")
    capsys.readouterr()
    assert main(["lineage", "show", str(d)]) == 0
    out, err = capsys.readouterr()
    assert "Trained in 2 continuation(s)" in out and "no earlier one trained on" not in out
    assert "prompt ids not read, so not checked for turns trained twice" in err
    assert "do not match the count and sha256" in err
