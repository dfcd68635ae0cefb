"""data/guard: record-level failures become counted skips, file-level ones a DFlashError naming
the file; and `prepare --overwrite` never deletes a directory this tool did not write."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_data_support import sharegpt, tiny_tokenizer, write_jsonl

import dflash_trainer.data.formats as formats_mod
from dflash_trainer.cli import main
from dflash_trainer.config import SourceConfig
from dflash_trainer.data.formats import read_records
from dflash_trainer.data.guard import guard_file
from dflash_trainer.data.jsonio import iter_file_values
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.records import ReadReport
from dflash_trainer.data.shards import read_manifest
from dflash_trainer.data.sources import read_source
from dflash_trainer.errors import DFlashError

GOOD = [sharegpt(("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(6)]
LONE = "lone \ud800 surrogate"  # json.dumps writes it as the escape \ud800
DEEP_LINE = "[" * 100_000 + "]" * 100_000
DEEP_RECORD = '{"conversations": ' + "[" * 50_000 + "]" * 50_000 + "}"


def _lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _read(path: Path, **kw: Any) -> tuple[list[Any], ReadReport]:
    report = ReadReport(source=str(path))
    return list(read_records(path, report=report, **kw)), report


# ---------------------------------------------------------------- record level


def test_lone_surrogates_in_content_or_id_are_counted_bad_utf8(tmp_path: Path) -> None:
    rows = [
        *GOOD,
        sharegpt(("human", LONE), ("gpt", "answer")),
        sharegpt(("human", "fine"), ("gpt", "fine"), rid="id \udc80"),
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": LONE}]},
    ]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    assert "\\ud800" in path.read_text()
    records, report = _read(path)
    assert len(records) == 6 and report.skipped == Counter(bad_utf8=3)
    out = prepare_dataset(path, tiny_tokenizer(), tmp_path / "o")
    assert read_manifest(out)["read_report"]["skipped"] == {"bad_utf8": 3}


def test_deep_nesting_is_counted_too_deep_and_the_read_goes_on(tmp_path: Path) -> None:
    lines = [json.dumps(GOOD[0]), DEEP_LINE, DEEP_RECORD, json.dumps(GOOD[1])]
    records, report = _read(_lines(tmp_path / "d.jsonl", lines))
    assert len(records) == 2 and report.skipped == Counter(too_deep=2)
    # In a JSON array the reader resynchronises after the deep element.
    array = "[" + ", ".join([json.dumps(GOOD[0]), DEEP_RECORD, json.dumps(GOOD[1])]) + "]"
    (tmp_path / "d.json").write_text(array)
    records, report = _read(tmp_path / "d.json")
    assert len(records) == 2 and report.skipped == Counter(too_deep=1)
    # YAML (ChatterBot): the file is one value.
    (tmp_path / "d.yml").write_text("conversations:\n- " + "[" * 5000 + "]" * 5000 + "\n")
    records, report = _read(tmp_path / "d.yml", require_assistant=False)
    assert records == [] and report.skipped == Counter(too_deep=1)
    # The prompt-source reader, with a mapping and without.
    path = _lines(tmp_path / "p.jsonl", ['{"q": "hello"}', '{"q": ' + DEEP_LINE + "}", DEEP_LINE])
    convs, rep = read_source(SourceConfig(name="s", path=str(path), prompt="q"))
    assert len(convs) == 1 and rep.skipped == Counter(too_deep=2)


def test_numbers_json_refuses_and_ids_outside_any_vocabulary(tmp_path: Path) -> None:
    lines = [
        json.dumps(GOOD[0]),
        '{"input_ids": [' + "9" * 5000 + '], "loss_mask": [1]}',  # int() digit limit
        '{"input_ids": [1, 99999999999999], "loss_mask": [1, 1]}',
        '{"input_ids": [-1, 5], "loss_mask": [0, 1]}',
    ]
    records, report = _read(_lines(tmp_path / "n.jsonl", lines))
    assert len(records) == 1 and report.skipped == Counter(bad_json=1, bad_tokens=2)


def test_an_unexpected_exception_is_a_counted_record_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = formats_mod.normalise

    def buggy(value: Any, fmt: str, require_assistant: bool, name: str) -> Any:
        if name.endswith(":2"):
            raise ZeroDivisionError("a bug in a normaliser")
        return real(value, fmt, require_assistant, name)

    monkeypatch.setattr(formats_mod, "normalise", buggy)
    records, report = _read(write_jsonl(tmp_path / "e.jsonl", GOOD))
    assert len(records) == 5 and report.skipped == Counter(record_error=1)
    assert report.errors == Counter(ZeroDivisionError=1)
    assert "unexpected errors (record_error): {'ZeroDivisionError': 1}" in report.format()
    assert ReadReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_encodings(tmp_path: Path) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in GOOD)
    for codec, name in [("utf-16", "UTF-16"), ("utf-32", "UTF-32"), ("utf-16-be", None)]:
        path = tmp_path / f"{codec}.jsonl"
        path.write_bytes(
            ("\ufeff" if codec == "utf-16-be" else "").encode(codec) + text.encode(codec)
        )
        with pytest.raises(DFlashError, match=rf"{path.name} is {name or 'UTF-16'} text.*iconv"):
            _read(path)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode())
    records, report = _read(tmp_path / "bom.jsonl")
    assert len(records) == 6 and not report.skipped  # the byte-order mark is skipped
    cafe = json.dumps(sharegpt(("human", "café crème"), ("gpt", "ok")), ensure_ascii=False)
    (tmp_path / "l1.jsonl").write_bytes(text.encode() + cafe.encode("latin-1") + b"\n")
    records, report = _read(tmp_path / "l1.jsonl")
    # The latin-1 record is skipped, not kept with U+FFFD in place of its letters.
    assert len(records) == 6 and report.skipped == Counter(bad_utf8=1)
    (tmp_path / "l1.yml").write_bytes("conversations:\n- [café, oui]\n".encode("latin-1"))
    records, report = _read(tmp_path / "l1.yml", require_assistant=False)
    assert records == [] and report.skipped == Counter(bad_utf8=1)


# ---------------------------------------------------------------- file level


@pytest.mark.parametrize("name", ["t.jsonl.gz", "t.json.gz"])
def test_truncated_gzip_is_a_clear_error_naming_the_file(tmp_path: Path, name: str) -> None:
    rows = [sharegpt(("human", f"question {i} " * 5), ("gpt", f"answer {i}")) for i in range(60)]
    body = (
        "".join(json.dumps(r) + "\n" for r in rows) if ".jsonl" in name else json.dumps(rows)
    ).encode()
    whole = gzip.compress(body)
    for cut in (1, 10, len(whole) // 2, len(whole) - 9, len(whole) - 1):
        path = tmp_path / name
        path.write_bytes(whole[:cut])
        with pytest.raises(DFlashError, match=rf"{name}: truncated or damaged gzip stream"):
            _read(path)
        with pytest.raises(DFlashError, match=rf"{name}: truncated or damaged gzip stream"):
            prepare_dataset(path, tiny_tokenizer(), tmp_path / "o")
        assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing written
    damaged = bytearray(whole)
    damaged[len(whole) // 2] ^= 0xFF
    (tmp_path / name).write_bytes(bytes(damaged))
    with pytest.raises(DFlashError, match="truncated or damaged gzip stream"):
        _read(tmp_path / name)


def test_a_file_gone_while_reading_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gone.jsonl"
    with pytest.raises(DFlashError, match=r"gone\.jsonl does not exist"):
        list(guard_file(path, iter_file_values(path)))
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DFlashError, match=r"dir\.jsonl is a directory"):
        list(guard_file(tmp_path / "dir.jsonl", iter_file_values(tmp_path / "dir.jsonl")))


# ---------------------------------------------------------------- what --out holds


def _prepare_cli(src: Path, out: Path, tok_dir: Path, *extra: str) -> list[str]:
    return ["data", "prepare", "--input", str(src), "--tokenizer", str(tok_dir), "--out", str(out),
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(d)
    return d


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ('{"name": "my web app", "version": 1}', "is not the manifest of a dataset prepared"),
        ('{"format": "dflash-prepared"}', "is not the manifest of a dataset prepared"),
        ('{"format": "dflash-prepared", "fingerprint": "x", "splits": {"train": 3}}', "damaged"),
        ('{"format": "dflash-prep', "is damaged: not readable JSON"),
        ("[1, 2]", "not a manifest: a JSON list"),
        ("\udcff", "is damaged: not readable JSON"),
    ],
)
def test_overwrite_never_deletes_a_directory_it_did_not_write(
    tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str], manifest: str, message: str
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", GOOD)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "manifest.json").write_bytes(manifest.encode("utf-8", "surrogateescape"))
    (out / "data.bin").write_bytes(b"precious")
    (out / "sub").mkdir()
    (out / "sub" / "notes.txt").write_text("keep me")
    before = _tree(out)
    assert main(_prepare_cli(src, out, tok_dir, "--overwrite")) == 2
    err = capsys.readouterr().err
    assert message in err and "not deleted" in err and str(out) in err
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "mine"]


def test_overwrite_keeps_a_prepared_dataset_with_extra_files(
    tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", GOOD)
    out = tmp_path / "prep"
    assert main(_prepare_cli(src, out, tok_dir)) == 0
    (out / "my_notes.md").write_text("keep me")
    before = _tree(out)
    assert main(_prepare_cli(src, out, tok_dir, "--overwrite", "--eval-fraction", "0.5")) == 2
    err = capsys.readouterr().err
    assert "my_notes.md" in err and "nothing was deleted" in err
    assert _tree(out) == before
    (out / "my_notes.md").unlink()  # ours alone again: --overwrite replaces it
    assert main(_prepare_cli(src, out, tok_dir, "--overwrite", "--eval-fraction", "0.5")) == 0
    assert read_manifest(out)["settings"]["eval_fraction"] == 0.5


def test_out_is_a_file_or_under_a_file(
    tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", GOOD)
    (tmp_path / "afile").write_text("data")
    assert main(_prepare_cli(src, tmp_path / "afile", tok_dir, "--overwrite")) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'afile'} is a file" in err
    assert (tmp_path / "afile").read_text() == "data"
    assert main(_prepare_cli(src, tmp_path / "afile" / "sub", tok_dir)) == 2
    assert "cannot create" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "data"


@pytest.mark.parametrize(
    "line",
    [b'{"id": "x", "generation": "caf\xe9"}', b"[" * 100_000, b'{"id": ["x"], "generation": {}}',
     b'{"id": "x", "generation": 3}', b'{"id": "x", "synthesis": [1]}', b"\xff\xfe{"],
)  # fmt: skip
def test_resuming_over_a_foreign_output_file_is_a_clear_error(tmp_path: Path, line: bytes) -> None:
    """regenerate/synthesize resume by reading their own output: anything else is refused."""
    from dflash_trainer.data.regen_output import read_done
    from dflash_trainer.data.settings import GenerationSettings
    from dflash_trainer.data.synthesize import SynthSettings, _read_lines

    path = tmp_path / "out.jsonl"
    path.write_bytes(line + b"\n")
    with pytest.raises(DFlashError, match=r"out\.jsonl: line 1 is not a regeneration record"):
        read_done(path, GenerationSettings("tiny"))
    with pytest.raises(DFlashError, match=r"out\.jsonl: line 1 is not a synthesis record"):
        _read_lines(path, SynthSettings(model="tiny"))
    assert path.read_bytes() == line + b"\n"  # refused, not truncated


def test_a_symlinked_out_is_reused_but_never_replaced(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", GOOD)
    real = prepare_dataset(src, tiny_tokenizer(), tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    assert prepare_dataset(src, tiny_tokenizer(), link) == link  # the trainer's shared data
    with pytest.raises(DFlashError, match="is a symbolic link"):
        prepare_dataset(src, tiny_tokenizer(), link, eval_fraction=0.5, overwrite=True)
    assert link.is_symlink() and read_manifest(real)["settings"]["eval_fraction"] == 0.02
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "link", "real"]
