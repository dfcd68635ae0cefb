"""Property-based fuzzing of damaged artifacts: an export and a prepared directory.

A tiny real z-lab export (`dflash export`) and a tiny real prepared directory (`dflash data
prepare`) are built once. Each example copies one of them, damages one of its files (cut
short, emptied, zeroed, a byte flipped, replaced by a directory, by a link to another file
of the directory or outside it, by a dangling link, by a FIFO) and runs the commands that
read it: `export --check`, `import` and `export` for the export; `plan --data`, `doctor
--data` and `data stats --verify` for the prepared directory. Each must end cleanly
(success, a failed check, or an error naming the problem) within its time limit: a
traceback or a hang fails the example. Counts are printed at the end of the module and
written to <pytest basetemp>/artifact_fuzz_counts.json.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzz_support import FUZZ, go_offline, run_command, show
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_data_support import sharegpt, tiny_tokenizer, write_jsonl
from test_export import tiny_spec, write_run, write_target

from dflash_trainer.cli import main
from dflash_trainer.formats.export import export_drafter

COUNTS: Counter[str] = Counter()
FAILURES: list[str] = []
DAMAGES = ["truncate", "empty", "zero", "flip", "directory", "link_inside", "link_outside",
           "dangling", "fifo"]  # fmt: skip
_serial = itertools.count()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("pristine")
    spec = tiny_spec()
    run, _ = write_run(tmp, spec)
    target = write_target(tmp, spec)
    export_drafter(run, tmp / "export", "zlab", "float32", target=str(target))
    tok = tmp / "tok"
    tiny_tokenizer().save_pretrained(tok)
    rows = [sharegpt(("human", f"question {i}"), ("gpt", f"answer {i} " * 3)) for i in range(12)]
    src = write_jsonl(tmp / "in.jsonl", rows)
    argv = ["data", "prepare", "--input", str(src), "--tokenizer", str(tok),
            "--out", str(tmp / "prepared"), "--eval-fraction", "0.2"]  # fmt: skip
    assert main(argv) == 0
    return {"export": tmp / "export", "prepared": tmp / "prepared"}


@pytest.fixture(scope="module", autouse=True)
def report_counts(request, tmp_path_factory) -> Iterator[None]:
    yield
    out = tmp_path_factory.getbasetemp() / "artifact_fuzz_counts.json"
    counts = {k: COUNTS[k] for k in ("tried", "clean", "tracebacks", "hangs")}
    counts["of which"] = {k: v for k, v in sorted(COUNTS.items()) if k not in counts}
    out.write_text(json.dumps({**counts, "failures": FAILURES[:20]}, indent=1))
    show(request, f"artifact fuzz: {json.dumps(counts)} ({out})")


def damage(f: Path, kind: str, where: float, outside: Path) -> None:
    """Damage file `f` in place; `where` in [0, 1) picks the cut or the flipped byte."""
    data = f.read_bytes()
    if kind == "truncate":
        f.write_bytes(data[: int(len(data) * where)])
    elif kind == "empty":
        f.write_bytes(b"")
    elif kind == "zero":
        f.write_bytes(bytes(len(data)))
    elif kind == "flip" and data:
        i = int(len(data) * where)
        f.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
    elif kind in ("directory", "link_inside", "link_outside", "dangling", "fifo"):
        f.unlink()
        if kind == "directory":
            f.mkdir()
        elif kind == "fifo":
            os.mkfifo(f)
        else:
            others = sorted(p for p in f.parent.iterdir() if p.is_file() and p != f)
            target = {
                "link_inside": others[0] if others else f.parent,
                "link_outside": outside,
                "dangling": f.parent / "gone",
            }[kind]
            f.symlink_to(target)


def commands(kind: str, d: Path, scratch: Path) -> list[list[str]]:
    if kind == "export":
        return [
            ["export", "--check", str(d)],
            ["import", str(d)],
            ["export", str(d), "--to", "speculators", str(scratch / "out")],
        ]
    recipe = ["--recipe", "qwen3.6-27b"]
    return [
        ["plan", *recipe, "--data", str(d)],
        ["doctor", *recipe, "--no-tokenizer", "--data", str(d)],
        ["data", "stats", str(d), "--verify"],
    ]


@pytest.fixture(autouse=True)
def offline(monkeypatch) -> None:
    go_offline(monkeypatch)


@settings(
    FUZZ,
    max_examples=100,
    suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_damaged_artifacts_end_cleanly(data, artifacts, tmp_path, capsys):
    kind = data.draw(st.sampled_from(sorted(artifacts)))
    scratch = tmp_path / f"ex{next(_serial)}"
    d = scratch / kind
    shutil.copytree(artifacts[kind], d)
    files = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    victim = d / data.draw(st.sampled_from(files))
    how = data.draw(st.sampled_from(DAMAGES))
    damage(victim, how, data.draw(st.floats(0, 0.999)), artifacts["export"] / "config.json")
    COUNTS[f"{kind}:{how}"] += 1
    for argv in commands(kind, d, scratch):
        run_command(argv, capsys, COUNTS, FAILURES, wall_seconds=30)
    shutil.rmtree(scratch, ignore_errors=True)
