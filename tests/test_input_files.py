"""Inputs are what they claim: regular files only, bounded gzip, shards inside their directory,
YAML without aliases or duplicate keys."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import pytest

from dflash_trainer.cli import main
from dflash_trainer.cli_errors import USER_ERROR
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import open_input, read_input_bytes


def _clean(argv: list[str], capsys, needle: str, limit_s: float = 20) -> str:
    t0 = time.perf_counter()
    rc = main(argv)
    elapsed = time.perf_counter() - t0
    out = capsys.readouterr()
    err = out.err + out.out
    assert rc in (1, USER_ERROR), err  # 1: doctor's failed check, 2: an error
    assert needle in err and "Traceback" not in err, err
    assert elapsed < limit_s
    return err


@pytest.fixture
def fifo(tmp_path) -> Path:
    p = tmp_path / "in.jsonl"
    os.mkfifo(p)
    return p


def test_a_fifo_is_refused_without_blocking(fifo, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    os.mkfifo(cfg)
    _clean(["plan", "--config", str(cfg)], capsys, "FIFO")
    _clean(["data", "prepare", "--input", str(fifo), "--out", str(tmp_path / "o")], capsys, "FIFO")
    _clean(
        ["doctor", "--recipe", "qwen3-8b", "--no-tokenizer", "--data", str(fifo)], capsys, "FIFO"
    )
    with pytest.raises(DFlashError, match="FIFO"):
        open_input(fifo)


def test_a_device_is_refused(capsys):
    _clean(["plan", "--config", "/dev/zero"], capsys, "a device")
    with pytest.raises(DFlashError, match="a device"):
        read_input_bytes("/dev/zero")


def test_a_gzip_bomb_is_an_error_naming_the_file(tmp_path, monkeypatch):
    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        for _ in range(64):
            f.write(b"\0" * (1 << 20))  # 64 MiB of zeros: ~65 KB compressed
    monkeypatch.setattr("dflash_trainer.input_files.MIN_EXPANSION_LIMIT", 1 << 20)
    t0 = time.perf_counter()
    with pytest.raises(DFlashError, match="decompression bomb"):
        read_input_bytes(bomb)
    assert time.perf_counter() - t0 < 5
    ok = tmp_path / "ok.jsonl.gz"
    ok.write_bytes(gzip.compress(b'{"text": "hello"}\n' * 10))
    assert read_input_bytes(ok).count(b"\n") == 10


def test_yaml_alias_bomb_is_refused_in_milliseconds(tmp_path, capsys):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    err = _clean(["plan", "--config", str(bomb)], capsys, "alias *a0 refused", limit_s=2)
    assert "line 2" in err
    src = tmp_path / "mix.yaml"
    src.write_text("sources:\n  - &s {name: a, path: x.jsonl}\n  - *s\n")
    _clean(["data", "prompts", "--sources", str(src), "--out", str(tmp_path / "p.jsonl")],
           capsys, "alias *s refused")  # fmt: skip


def test_duplicate_keys_are_an_error(tmp_path, capsys):
    cfg = tmp_path / "dup.yaml"
    cfg.write_text("training:\n  lr: 1e-3\n  lr: 1e-4\n")
    _clean(["plan", "--config", str(cfg)], capsys, "duplicate key 'lr' (first at line 2)")
    _clean(["plan", "--recipe", "qwen3-8b", "run.storage_options={a: 1, a: 2}"], capsys,
           "duplicate key 'a'")  # fmt: skip


def test_a_manifest_cannot_name_shards_outside_its_directory(tmp_path, capsys):
    from dflash_trainer.data.shards import MANIFEST, PreparedDataset, ShardWriter

    d = tmp_path / "prep"
    w = ShardWriter(d, "train")
    import numpy as np

    w.add("a", np.arange(1, 6, dtype=np.int32), np.ones(5, dtype=bool))
    entries = w.close()
    (tmp_path / "outside").mkdir()
    for name in ("../outside", "/etc", "..", "train-00000/../../outside"):
        bad = [dict(entries[0], name=name)]
        manifest = {"format": "dflash-prepared", "version": 1, "splits": {"train": {"shards": bad}}}
        (d / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(DFlashError, match=r"not a plain name|leads outside"):
            PreparedDataset(d)
    (d / "link").symlink_to(tmp_path / "outside")
    manifest["splits"]["train"]["shards"] = [dict(entries[0], name="link")]
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DFlashError, match="leads outside"):
        PreparedDataset(d)


# ---------------------------------------------------------------- JSON the tool reads back


def test_json_is_read_from_regular_files_only_and_never_waited_on(fifo, tmp_path):
    from dflash_trainer.json_input import read_json

    t0 = time.perf_counter()
    with pytest.raises(DFlashError, match="FIFO"):
        read_json(fifo, "run info")
    with pytest.raises(DFlashError, match="is a directory"):
        read_json(tmp_path, "run info")
    assert time.perf_counter() - t0 < 1
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"x": "y" * 2000}))
    with pytest.raises(DFlashError, match="larger than 1,000 bytes"):
        read_json(big, "checksums", max_bytes=1000)


@pytest.mark.parametrize("depth", [65, 1000, 200_000])
def test_json_nested_too_deeply_is_a_user_error_not_a_recursion_error(tmp_path, depth):
    """A million `[` crash the parser and a few hundred crash the first recursive walk or
    indented dump of the value: both are refused as a damaged file."""
    from dflash_trainer.json_input import MAX_DEPTH, read_json

    p = tmp_path / "deep.json"
    p.write_text('{"a": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(DFlashError, match=f"nested more than {MAX_DEPTH} levels"):
        read_json(p, "lineage")
    p.write_text('{"a": ' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}")
    assert read_json(p, "lineage")["a"]  # as deep as allowed: read


def test_json_of_another_type_names_both_types(tmp_path):
    from dflash_trainer.json_input import is_number, read_json

    p = tmp_path / "meta.json"
    p.write_text("[1, 2]")
    with pytest.raises(DFlashError, match="a JSON array, not a JSON object"):
        read_json(p, "checkpoint meta")
    p.write_bytes(b"\xff\xfe{")
    with pytest.raises(DFlashError, match="not UTF-8"):
        read_json(p, "checkpoint meta")
    assert [is_number(v) for v in (1, 0.5, True, float("nan"), float("inf"), "1", None)] == [
        True, True, False, False, False, False, False,
    ]  # fmt: skip
