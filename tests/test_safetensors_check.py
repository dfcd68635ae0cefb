"""Damaged weights are refused, by name, before anything loads them.

Truncated data, a header that lies about a shape or an offset, a header length of petabytes,
a link to another file, a directory in the file's place and NaN weights: `export --check`,
`import`, `export` and `eval` each answer with one error naming the file, never a traceback,
and without reading more than the header.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest
from test_export import tiny_spec, write_run, write_target

from dflash_trainer.cli import main
from dflash_trainer.cli_errors import USER_ERROR
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.export import export_drafter
from dflash_trainer.formats.safetensors_check import check_safetensors


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("st")
    spec = tiny_spec()
    run, _ = write_run(tmp, spec)
    target = write_target(tmp, spec)
    out = tmp / "export"
    export_drafter(run, out, "zlab", "float32", target=str(target))
    return out


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8 : 8 + n])


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    n, header = _header(path)
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _lie_about_shape(header: dict) -> None:
    header[_first_tensor(header)]["shape"][0] += 1


def _lie_about_offsets(header: dict) -> None:
    name = _first_tensor(header)
    header[name]["data_offsets"][1] += 4


def damage(kind: str, f: Path, elsewhere: Path) -> None:
    if kind == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
    elif kind == "tiny":
        f.write_bytes(b"\x01\x02")
    elif kind == "huge_header":
        f.write_bytes((2**62).to_bytes(8, "little") + f.read_bytes()[8:])
    elif kind == "header_past_end":
        f.write_bytes((10**6).to_bytes(8, "little") + f.read_bytes()[8:])
    elif kind == "shape_lie":
        _rewrite_header(f, _lie_about_shape)
    elif kind == "offset_lie":
        _rewrite_header(f, _lie_about_offsets)
    elif kind == "not_json":
        raw = f.read_bytes()
        f.write_bytes(raw[:8] + b"\xff" * 16 + raw[24:])
    elif kind == "symlink":
        f.unlink()
        f.symlink_to(elsewhere)
    elif kind == "directory":
        f.unlink()
        f.mkdir()
    elif kind == "fifo":
        f.unlink()
        os.mkfifo(f)
    else:
        raise AssertionError(kind)


KINDS = [
    "truncated",
    "tiny",
    "huge_header",
    "header_past_end",
    "shape_lie",
    "offset_lie",
    "not_json",
    "symlink",
    "directory",
    "fifo",
]


@pytest.mark.parametrize("kind", KINDS)
def test_check_import_export_refuse_a_damaged_file(kind, export_dir, tmp_path, capsys):
    d = tmp_path / "export"
    shutil.copytree(export_dir, d)
    elsewhere = tmp_path / "other.safetensors"
    shutil.copy(export_dir / "model.safetensors", elsewhere)  # a valid file, but not this one
    damage(kind, d / "model.safetensors", elsewhere)
    t0 = time.perf_counter()
    runs = {
        "check": ["export", "--check", str(d)],
        "import": ["import", str(d)],
        "export": ["export", str(d), "--to", "speculators", str(tmp_path / "out")],
        "eval": ["eval", "--drafter", str(d), "--prompts", "gsm8k", "--max-samples", "1"],
    }
    for what, argv in runs.items():
        rc = main(argv)
        out = capsys.readouterr()
        text = out.out + out.err
        assert rc in (1, USER_ERROR), (what, text)
        assert "Traceback" not in text and "internal error" not in text, (what, text)
        assert "model.safetensors" in text, (what, text)
    assert time.perf_counter() - t0 < 60
    assert not (tmp_path / "out").exists()


def test_the_validator_accepts_what_safetensors_writes(export_dir):
    tensors = check_safetensors(export_dir / "model.safetensors")
    assert tensors and all(math.prod(t.shape) > 0 for t in tensors.values())


def test_nan_weights_are_refused_by_import_and_eval_naming_the_tensor(tmp_path, capsys):
    spec = tiny_spec()
    run, model = write_run(tmp_path, spec)
    state = model.state_dict()
    name = sorted(state)[3]
    state[name][0] = float("nan")
    from dflash_trainer.formats.drafter_io import save_drafter_files

    save_drafter_files(run / "drafter", spec, state, {})
    for argv in (["import", str(run)], ["eval", "--drafter", str(run), "--max-samples", "1"]):
        assert main(argv) == USER_ERROR
        err = capsys.readouterr().err
        assert name in err and "NaN or inf" in err


def test_a_link_inside_the_directory_is_fine_and_one_outside_is_not(export_dir, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(export_dir / "model.safetensors", d / "real.safetensors")
    (d / "model.safetensors").symlink_to("real.safetensors")
    assert check_safetensors(d / "model.safetensors", root=d)
    with pytest.raises(DFlashError, match="outside the drafter's directory"):
        check_safetensors(d / "model.safetensors", root=tmp_path / "elsewhere")


def test_header_check_reads_only_the_header(tmp_path):
    # A 2 GiB sparse file whose header says the data is there: checked without reading it.
    f = tmp_path / "big.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**29], "data_offsets": [0, 2**31]}})
    header += " " * (-len(header) % 8)
    with open(f, "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header.encode())
        fh.truncate(8 + len(header) + 2**31)
    t0 = time.perf_counter()
    assert check_safetensors(f)["w"].shape == (2**29,)
    assert time.perf_counter() - t0 < 1


def test_weights_files_follow_the_umask_not_owner_only(export_dir, tmp_path):
    """safetensors creates its files 0600; a serving engine running as another user must
    still read an export (and a run's drafter), so the tool's files follow the umask."""
    old = os.umask(0o022)
    try:
        out = tmp_path / "again"
        export_drafter(export_dir, out, fmt="zlab")
    finally:
        os.umask(old)
    weights = [p for p in out.iterdir() if p.suffix == ".safetensors"]
    assert weights and all(p.stat().st_mode & 0o777 == 0o644 for p in weights)
