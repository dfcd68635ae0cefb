"""atomic_dir: directories written whole or not at all, and what killed writers leave behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_data_support import sharegpt, tiny_tokenizer, write_jsonl

from dflash_trainer.atomic_dir import (
    MARKER,
    atomic_directory,
    check_replaceable,
    remove_stale,
    temp_name,
)
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.shards import PreparedDataset
from dflash_trainer.errors import DFlashError

TESTS = Path(__file__).parent


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_publish_replaces_whole_and_a_failure_changes_nothing(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with atomic_directory(final) as tmp:
        assert tmp.parent == tmp_path and tmp.name == temp_name("out")
        (tmp / "a.txt").write_text("one")
        assert not final.exists()  # nothing visible until the body returns
    assert (final / "a.txt").read_text() == "one"

    def failing_write() -> None:
        with atomic_directory(final, replace=True) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        failing_write()
    assert [p.name for p in final.iterdir()] == ["a.txt"]
    assert (final / "a.txt").read_text() == "one"
    with atomic_directory(final, replace=True) as tmp:
        (tmp / "b.txt").write_text("two")
    assert [p.name for p in final.iterdir()] == ["b.txt"]  # replaced whole, not merged

    def write_without_replace() -> None:
        with atomic_directory(final):
            pass

    with pytest.raises(DFlashError, match="appeared while"):
        write_without_replace()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left


def _named(parent: Path, name: str, pid: int, kind: str = "tmp") -> Path:
    """The path a writer with process id `pid` on this host uses for `name`."""
    return parent / f"{temp_name(name, kind).rsplit('-', 1)[0]}-{pid}"


def _leftover(parent: Path, name: str, pid: int, kind: str = "tmp") -> Path:
    """What a killed writer `pid` of this tool on this host leaves: the directory and its
    marker (as `atomic_directory` writes it)."""
    d = _named(parent, name, pid, kind)
    d.mkdir()
    host = d.name.rsplit("-", 2)[1]
    (d / MARKER).write_text(json.dumps({"tool": "dflash-trainer", "host": host, "pid": pid}))
    return d


def test_stale_temps_are_removed_and_reported_live_and_foreign_ones_kept(
    tmp_path: Path,
) -> None:
    dead_pid = _dead_pid()
    dead = _leftover(tmp_path, "out", dead_pid)
    (dead / "half.bin").write_bytes(b"x")
    old = _leftover(tmp_path, "out", dead_pid, "old")
    other_name = _leftover(tmp_path, "other", dead_pid)
    lookalike_file = _named(tmp_path, "file", dead_pid)
    lookalike_file.write_text("a file, not a directory: not ours")
    foreign = tmp_path / ".out.tmp-othernode-12345"
    foreign.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = _named(tmp_path, "out", sleeper.pid)
        live.mkdir()
        said: list[str] = []
        removed = remove_stale(tmp_path, "out", log=said.append)
        assert sorted(removed) == sorted([dead, old])
        assert not dead.exists() and not old.exists()
        assert live.exists() and foreign.exists() and other_name.exists()
        assert lookalike_file.exists()
        assert any(f"removed {dead}" in s and "interrupted write" in s for s in said)
        assert any(f"left {foreign} alone" in s and "othernode" in s for s in said)
        # Without a name (the checkpointer's sweep): every dead writer's directory goes.
        assert remove_stale(tmp_path, log=said.append) == [other_name]
        assert live.exists() and foreign.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_check_replaceable_names_strays_and_deletes_nothing(tmp_path: Path) -> None:
    ours = {"a.json"}.__contains__
    check_replaceable(tmp_path / "absent", ours, "x")
    (tmp_path / "f").write_text("data")
    with pytest.raises(DFlashError, match="exists and is not a directory"):
        check_replaceable(tmp_path / "f", ours, "x")
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.json").write_text("{}")
    check_replaceable(d, ours, "x")
    (d / "notes.txt").write_text("mine")
    with pytest.raises(DFlashError, match=r"not part of x \(notes\.txt\); nothing was deleted"):
        check_replaceable(d, ours, "x")
    assert sorted(p.name for p in d.iterdir()) == ["a.json", "notes.txt"]


KILLED_PREPARE = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_data_support import tiny_tokenizer
    import dflash_trainer.data.prepare as prepare_mod

    real = prepare_mod.split_of
    seen = []
    def slow_split_of(doc_id, fraction):
        seen.append(doc_id)
        if len(seen) == 5:  # some shards are open in the temporary directory by now
            print("writing", flush=True)
            time.sleep(120)
        return real(doc_id, fraction)

    prepare_mod.split_of = slow_split_of
    prepare_mod.prepare_dataset({src!r}, tiny_tokenizer(), {out!r})
    """
)


def test_a_killed_prepare_is_cleaned_up_by_the_next_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    rows = [sharegpt(("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(20)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "prep"
    script = tmp_path / "prepare.py"
    script.write_text(KILLED_PREPARE.format(tests=str(TESTS), src=str(src), out=str(out)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        temps = list(tmp_path.glob(".prep.tmp-*"))
        assert len(temps) == 1 and temps[0].name.endswith(f"-{proc.pid}")
        assert (temps[0] / "train-00000" / "tokens.bin").exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not out.exists() and temps[0].exists()  # what kill -9 leaves
    capfd.readouterr()
    prepare_dataset(src, tiny_tokenizer(), out)
    err = capfd.readouterr().err
    assert f"removed {temps[0]}" in err and f"process {proc.pid} is gone" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "prep", "prepare.py"]
    assert len(PreparedDataset(out)) + len(PreparedDataset(out, "eval")) == 20


def test_a_dead_writers_temp_is_removed_even_when_the_output_is_reused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    rows = [sharegpt(("human", f"q {i}"), ("gpt", f"a {i}")) for i in range(5)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = prepare_dataset(src, tiny_tokenizer(), tmp_path / "prep")
    stale = _leftover(tmp_path, "prep", _dead_pid())
    mtime = (out / "manifest.json").stat().st_mtime_ns
    capfd.readouterr()
    assert prepare_dataset(src, tiny_tokenizer(), out) == out
    assert (out / "manifest.json").stat().st_mtime_ns == mtime  # reused
    assert not stale.exists() and f"removed {stale}" in capfd.readouterr().err


def test_our_own_pid_in_a_leftover_name_is_stale_unless_we_are_writing_it(
    tmp_path: Path,
) -> None:
    """After a restart (a container) a new process may get the killed one's id."""
    leftover = _leftover(tmp_path, "out", os.getpid())
    assert leftover.name == temp_name("out")
    said: list[str] = []
    assert remove_stale(tmp_path, "out", log=said.append) == [leftover]
    with atomic_directory(tmp_path / "out", log=said.append) as tmp:
        assert remove_stale(tmp_path, "out", log=said.append) == []  # active: ours, now
        assert tmp.exists()
    assert os.listdir(tmp_path) == ["out"]


def test_remove_stale_on_a_missing_parent_is_a_no_op(tmp_path: Path) -> None:
    assert remove_stale(tmp_path / "nope") == []
    (tmp_path / "f").write_text("x")
    assert remove_stale(tmp_path / "f", "x") == []


def test_the_current_directory_is_never_the_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)

    def write(final: str) -> None:
        with atomic_directory(final, replace=True):
            pass

    for final in (".", "..", str(here)):
        with pytest.raises(DFlashError, match="is the current directory or holds it"):
            write(final)
    assert here.is_dir() and sorted(os.listdir(tmp_path)) == ["here"]


def test_fsync_path_raises_for_a_file_and_tolerates_a_directory(tmp_path: Path) -> None:
    """One durability policy: a file that cannot be synced is an error (its data may not be on
    disk); a directory is synced as far as the file system allows."""
    from dflash_trainer.atomic_dir import fsync_path

    (tmp_path / "f.bin").write_bytes(b"x")
    fsync_path(tmp_path / "f.bin")
    fsync_path(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_path(tmp_path / "gone.bin")


def test_only_marked_temporaries_of_this_tool_are_ever_removed(tmp_path: Path) -> None:
    """Named like ours is not enough: another program's `.x.tmp-host-pid`, a copy, a marker
    naming another writer or a link to elsewhere are all kept, and named."""
    dead_pid = _dead_pid()
    unmarked = _named(tmp_path, "out", dead_pid)
    unmarked.mkdir()
    (unmarked / "theirs.bin").write_bytes(b"x")
    wrong = _named(tmp_path, "two", dead_pid)
    wrong.mkdir()
    (wrong / MARKER).write_text(json.dumps({"tool": "dflash-trainer", "host": "h", "pid": 1}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / MARKER).write_text("{}")
    link = _named(tmp_path, "three", dead_pid)
    link.symlink_to(elsewhere)
    foreign = [tmp_path / ".tmp-x", tmp_path / ".cache.tmp-editor"]
    for f in foreign:
        f.mkdir()
    said: list[str] = []
    assert remove_stale(tmp_path, log=said.append) == []
    for p in (unmarked, wrong, link, elsewhere, *foreign):
        assert p.exists(), p
    assert (unmarked / "theirs.bin").exists()
    assert any(f"left {unmarked} alone" in s and "marker" in s for s in said), said
    # A look-alike in the way of a write is an error, not a deletion.
    (tmp_path / temp_name("out")).mkdir()
    (tmp_path / temp_name("out") / "theirs.bin").write_bytes(b"x")
    with (
        pytest.raises(DFlashError, match="not known to be a temporary directory"),
        atomic_directory(tmp_path / "out"),
    ):
        pass
    assert (tmp_path / temp_name("out")).is_dir() and not (tmp_path / "out").exists()


def test_outputs_never_hold_the_marker(tmp_path: Path) -> None:
    with atomic_directory(tmp_path / "out") as tmp:
        assert (tmp / MARKER).is_file()
        (tmp / "a").write_text("1")
    assert os.listdir(tmp_path / "out") == ["a"]


def test_bare_temps_of_dead_writers_are_removed_and_nothing_with_content(tmp_path: Path) -> None:
    """A writer killed between creating its temporary directory and finishing its marker
    leaves it empty or with a marker cut short: removed. One with a whole marker naming
    another writer, or with anything else in it, is kept."""
    dead_pid = _dead_pid()
    empty = _named(tmp_path, "out", dead_pid)
    empty.mkdir()
    cut = _named(tmp_path, "two", dead_pid)
    cut.mkdir()
    (cut / MARKER).write_text('{"tool": "dflash-tr')
    file_stage = _named(tmp_path, "r.json", dead_pid).with_name(
        _named(tmp_path, "r.json", dead_pid).name.replace(".tmp-", ".tmp.0123abcd-")
    )
    file_stage.mkdir()  # what write_file_atomic's writer left: its marker and the bytes
    host = file_stage.name.rsplit("-", 2)[1]
    (file_stage / MARKER).write_text(
        json.dumps({"tool": "dflash-trainer", "host": host, "pid": dead_pid})
    )
    (file_stage / "content").write_text("half a report")
    other = _named(tmp_path, "three", dead_pid)
    other.mkdir()
    (other / MARKER).write_text(json.dumps({"tool": "dflash-trainer", "host": "h", "pid": 1}))
    full = _named(tmp_path, "four", dead_pid)
    full.mkdir()
    (full / MARKER).write_text("not json")
    (full / "theirs.bin").write_bytes(b"x")
    said: list[str] = []
    assert sorted(remove_stale(tmp_path, log=said.append)) == sorted([empty, cut, file_stage])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other.name, full.name])
    assert (full / "theirs.bin").exists() and (other / MARKER).exists()


def test_a_file_of_the_longest_name_is_written_on_a_host_of_the_longest_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary of a 255-byte file name stays within 255 bytes with a 64-byte host name
    (a Kubernetes pod's) and a 7-digit pid; a missing directory is not created."""
    from dflash_trainer.atomic_dir import write_file_atomic

    monkeypatch.setattr("socket.gethostname", lambda: "h" * 64)
    final = tmp_path / ("n" * 255)
    assert len(_named(tmp_path, final.name, 4194304).name) <= 255 - len(".0123abcd")
    write_file_atomic(final, "x")
    assert final.read_text() == "x" and os.listdir(tmp_path) == [final.name]
    with pytest.raises(DFlashError, match="No such file or directory"):
        write_file_atomic(tmp_path / "missing" / "r.json", "x")
    assert os.listdir(tmp_path) == [final.name]
