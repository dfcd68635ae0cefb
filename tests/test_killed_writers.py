"""Writers killed midway, and two writers of one output at once (issue 32).

- no writer opens a final name for writing: every file is written to a temporary sibling of
  this process and renamed into place (atomic_dir.write_file_atomic), every directory is
  published whole, so a kill at any instant leaves the previous file or the new one, never a
  truncated report, plot, lineage or model card. Checked by watching every open() of the real
  commands (append-only logs, `regenerate` and `synthesize`, excepted: their records are
  appended with one write each, and a partial last line is dropped on resume);
- SIGTERM ends a command like Ctrl-C: exit 143, its temporary directory removed, its lock
  released, the previous output intact, and the rerun succeeds;
- a second writer of an output that another process is writing is refused, naming that
  process, before it reads or loads anything; the output is not touched.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import go_offline
from hostile_support import SRC, World, build_world, eval_args, report_ok, tree

from dflash_trainer.cli import main
from dflash_trainer.cli_errors import TERMINATED, USER_ERROR
from dflash_trainer.data.shards import PreparedDataset

pytestmark = pytest.mark.usefixtures("one_thread")
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("world"))


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    go_offline(monkeypatch)


@pytest.fixture(autouse=True)
def interruptible_children() -> Iterator[None]:
    """The commands these tests start get SIGINT as from a terminal. A child inherits SIGINT
    only where this process ignores it (an ignored signal survives exec, and Python then
    installs no KeyboardInterrupt): a test runner's worker that ignores it would make the
    children deaf to the Ctrl-C under test. Python's own handler here gives them the default."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


_TEMP = re.compile(r"^\..+\.(tmp|old)(\.[0-9a-f]{8})?-[A-Za-z0-9_.]+-\d+$")  # atomic_dir's names
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


@contextmanager
def opened_for_writing(root: Path) -> Iterator[list[Path]]:
    """The paths under `root` that the body opens for writing (open, io.open, os.open)."""
    seen: list[Path] = []
    real_open, real_os_open = builtins.open, os.open

    def note(path: Any) -> None:
        if isinstance(path, str | bytes | os.PathLike):
            p = Path(os.path.abspath(os.fsdecode(path)))
            if p.is_relative_to(root):
                seen.append(p)

    def spy_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if any(c in mode for c in "wax+"):
            note(file)
        return real_open(file, mode, *a, **k)

    def spy_os_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if flags & _WRITE_FLAGS:
            note(path)
        return real_os_open(path, flags, *a, **k)

    builtins.open = io.open = spy_open  # type: ignore[assignment]
    os.open = spy_os_open  # type: ignore[assignment]
    try:
        yield seen
    finally:
        builtins.open = io.open = real_open
        os.open = real_os_open


def _in_temporary(p: Path, root: Path) -> bool:
    """A temporary file of this process, or a file inside a temporary directory, or a lock."""
    parts = p.relative_to(root).parts
    return any(_TEMP.match(part) for part in parts) or p.name.endswith(".dflash-lock")


WRITERS: dict[str, Callable[[World, Path], list[str]]] = {
    "eval --out-dir --json": lambda w, d: [
        *eval_args(w),
        "--out-dir",
        str(d / "e"),
        "--json",
        str(d / "r.json"),
    ],
    "lineage add-eval": lambda w, d: ["lineage", "add-eval", str(d / "drafter"), str(w.report)],
    "lineage init": lambda w, d: ["lineage", "init", str(d / "bare"), "--steps", "3"],
    "prompts": lambda w, d: [
        "data",
        "prompts",
        "--sources",
        str(w.sources),
        "--out",
        str(d / "p.jsonl"),
        "--decontam-evals",
        "none",
    ],
    "plot": lambda w, d: ["plot", str(d / "run"), "--out", str(d / "plots")],
    "export": lambda w, d: ["export", str(w.run), "--to", "zlab", str(d / "x")],
    "import": lambda w, d: ["import", str(w.export), "--out", str(d / "i")],
}


def _stage(world: World, d: Path) -> None:
    """What the writers replace or extend: earlier outputs, a drafter without a lineage."""
    import shutil

    shutil.copytree(world.drafter, d / "drafter")
    shutil.copytree(world.export, d / "bare")
    for name in ("lineage.json", "lineage_prompts.jsonl.gz"):
        (d / "bare" / name).unlink(missing_ok=True)  # an export of a lineage
    shutil.copytree(world.run, d / "run")
    shutil.copytree(world.report.parent, d / "e")


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_no_writer_opens_a_final_name_for_writing(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str], writer: str
) -> None:
    _stage(world, tmp_path)
    with opened_for_writing(tmp_path) as seen:
        rc = main(WRITERS[writer](world, tmp_path))
    assert rc == 0, capsys.readouterr().err
    assert seen, "the spy saw no write: it watches the wrong functions"
    at_final_names = sorted({str(p) for p in seen if not _in_temporary(p, tmp_path)})
    assert not at_final_names, f"{writer} wrote these in place: {at_final_names}"


PAUSED_PREPARE = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    import dflash_trainer.data.prepare as prepare_mod
    from dflash_trainer.cli import main

    real, seen = prepare_mod.split_of, []
    def paused_split_of(doc_id, fraction):
        seen.append(doc_id)
        if len(seen) == 3:  # the temporary directory holds open shards by now
            print("writing", flush=True)
            time.sleep(120)
        return real(doc_id, fraction)

    prepare_mod.split_of = paused_split_of
    sys.exit(main(sys.argv[1:]))
    """
)


def test_sigterm_ends_a_writer_cleanly_and_keeps_the_previous_output(
    world: World, tmp_path: Path
) -> None:
    out = tmp_path / "prep"
    argv = ["data", "prepare", "--input", str(world.conversations), "--tokenizer",
            str(world.target), "--out", str(out), "--eval-fraction", "0"]  # fmt: skip
    assert main([*argv, "--max-records", "3"]) == 0
    before = tree(out)
    script = tmp_path / "paused.py"
    script.write_text(PAUSED_PREPARE.format(tests=str(TESTS)))
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, str(script), *argv, "--overwrite"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        assert [p.name for p in tmp_path.glob(".prep.tmp-*")]  # the write under way
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == TERMINATED and "terminated (SIGTERM)" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["paused.py", "prep"]  # no temp, lock
    assert tree(out) == before
    assert main([*argv, "--overwrite"]) == 0
    assert len(PreparedDataset(out)) == 6


HOLDER = textwrap.dedent(
    """
    import sys, time
    from dflash_trainer.dir_lock import acquire_output
    acquire_output(sys.argv[1], "dflash holder", "the output")
    print("locked", flush=True)
    time.sleep(120)
    """
)

HELD: dict[str, tuple[str, Callable[[World, Path], list[str]]]] = {
    # name: (the output the other process writes, relative to the test dir; the command)
    "regenerate": ("a.jsonl", lambda w, d: ["data", "regenerate", "--input", str(w.conversations),
                                            "--model", str(w.target), "--out", str(d / "a.jsonl")]),
    "synthesize": ("s.jsonl", lambda w, d: ["data", "synthesize", "--model", str(w.target),
                                            "--out", str(d / "s.jsonl"), "--n", "2"]),
    "prompts": ("p.jsonl", WRITERS["prompts"]),
    "eval --json": ("r.json", lambda w, d: [*eval_args(w), "--json", str(d / "r.json")]),
    "eval --out-dir": ("e", lambda w, d: [*eval_args(w), "--out-dir", str(d / "e")]),
    "export": ("x", WRITERS["export"]),
    "import": ("i", WRITERS["import"]),
    "lineage add-eval": ("drafter", WRITERS["lineage add-eval"]),
    "lineage init": ("bare", WRITERS["lineage init"]),
}  # fmt: skip


@pytest.mark.parametrize("writer", sorted(HELD))
def test_a_second_writer_of_an_output_is_refused_naming_the_first(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str], writer: str
) -> None:
    _stage(world, tmp_path)
    name, argv = HELD[writer]
    before = tree(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / name)], env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        rc = main(argv(world, tmp_path))
    finally:
        holder.kill()
        holder.wait()
    err = " ".join(capsys.readouterr().err.split())
    assert rc == USER_ERROR and f"in use by `dflash holder` (process {holder.pid}" in err, err
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if "dflash-lock" not in k} == before


KILLED_AT_WRITE = textwrap.dedent(
    """
    import os, sys, time
    from dflash_trainer.cli import main

    real_fsync = os.fsync
    def paused_fsync(fd):  # the report's bytes are written, not yet renamed into place
        name = os.readlink(f"/proc/self/fd/{fd}")
        if "/.r.json." in name and ".tmp" in name:
            print("writing", flush=True)
            time.sleep(120)
        real_fsync(fd)

    os.fsync = paused_fsync
    sys.exit(main(sys.argv[1:]))
    """
)


def test_what_a_killed_file_writer_left_is_removed_by_the_next_one_and_nothing_else(
    world: World, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """kill -9 while `eval --json` writes its report leaves its temporary and its lock; the
    next eval of the same report removes both and writes it whole. Another program's
    `.x.tmp` and `.r.json.tmp`, and the temporary of a writer still running, are kept."""
    from dflash_trainer.atomic_dir import MARKER, temp_name

    out = tmp_path / "r.json"
    script = tmp_path / "killed.py"
    script.write_text(KILLED_AT_WRITE)
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    argv = [*eval_args(world), "--json", str(out)]
    proc = subprocess.Popen([sys.executable, str(script), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("killed.py", "r.json"))
    assert len(left) == 2 and ".r.json.dflash-lock" in left, left  # its temporary, its lock
    foreign = [tmp_path / ".x.tmp", tmp_path / ".r.json.tmp"]
    for f in foreign:
        f.write_text("another program's")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / temp_name("r.json").replace(".tmp-", ".tmp.0123abcd-").rsplit("-", 1)[0]
        live = live.with_name(f"{live.name}-{sleeper.pid}")
        live.mkdir()
        host = live.name.rsplit("-", 2)[1]
        (live / MARKER).write_text(
            json.dumps({"tool": "dflash-trainer", "host": host, "pid": sleeper.pid})
        )
        (live / "content").write_text("being written")
        capfd.readouterr()
        assert main(argv) == 0
        err = capfd.readouterr().err
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == sorted(["killed.py", "r.json", live.name, ".x.tmp", ".r.json.tmp"]), err
        assert f"process {proc.pid} is gone" in err, err
        assert report_ok(out)
        assert (live / "content").read_text() == "being written"
        assert all(f.read_text() == "another program's" for f in foreign)
    finally:
        sleeper.kill()
        sleeper.wait()


SLOW_SHUTDOWN = textwrap.dedent(
    """
    import atexit, sys, time
    from dflash_trainer import cli_streams, dir_lock
    from dflash_trainer.cli import main

    stage = sys.argv.pop(1)
    real_release = dir_lock.DirLock.release
    def pause():
        print("shutting down", flush=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not getattr(cli_streams, "_Signals", None):
            time.sleep(0.05)  # (the code before the fix: the signal ends it here)
        while time.monotonic() < deadline and not cli_streams._Signals.pending:
            time.sleep(0.05)  # until the test's signal has come

    def slow_release(self):  # the output's lock, released once the import is in place
        if stage == "release":
            pause()
        real_release(self)

    class Finalized:  # torch's teardown, say: after the exit callbacks, Python's handlers gone
        def __del__(self):
            print("shutting down", flush=True)
            time.sleep(3)  # the test's signal comes now

    dir_lock.DirLock.release = slow_release
    if stage == "exit":
        atexit.register(pause)  # the interpreter's exit, after main() returned
    if stage == "teardown":
        kept_until_teardown = Finalized()
    sys.exit(main())
    """
)


@pytest.mark.parametrize("stage", ["release", "exit", "teardown"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_shutdown_keeps_the_status_and_the_output(
    world: World, tmp_path: Path, stage: str, signum: int
) -> None:
    """Ctrl-C or SIGTERM once `dflash import` has written its output (while it releases its
    lock, while the interpreter runs its exit callbacks, or tears itself down) does not make
    it a failure: exit 0, the output whole, the summary printed, no lock left."""
    out = tmp_path / "d"
    script = tmp_path / "slow.py"
    script.write_text(SLOW_SHUTDOWN)
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, str(script), stage, "import", str(world.export), "--out", str(out)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        while not lines or lines[-1] != "shutting down":
            line = proc.stdout.readline()
            assert line, f"ended before its shutdown: {lines}"
            lines.append(line.strip())
        proc.send_signal(signum)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    printed = "\n".join([*lines, rest])
    assert proc.returncode == 0, (proc.returncode, err)
    assert "Traceback" not in err and "interrupted" not in err and "terminated" not in err, err
    assert f"wrote {out / 'spec.json'}" in printed, printed
    if stage == "release":  # said, not silently swallowed
        assert "came after the outputs were written" in err, err
    assert sorted(p.name for p in out.iterdir()) == [
        "drafter.safetensors", "meta.json", "spec.json"]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "slow.py"]  # no lock, no temp
    assert main(["import", str(out)]) == 0  # what it wrote reads back


SIGNAL_IN_SWAP = textwrap.dedent(
    """
    import os, signal, sys
    import dflash_trainer.atomic_dir as atomic_dir
    from dflash_trainer.cli import main

    real = atomic_dir._write_marker
    def marked_then_signalled(d):  # the previous directory is aside, the new one not yet in
        real(d)
        if ".old-" in d.name:
            os.kill(os.getpid(), signal.{signal})
    atomic_dir._write_marker = marked_then_signalled
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_while_a_directory_is_swapped_in_loses_neither(
    world: World, tmp_path: Path, name: str
) -> None:
    """Between moving the previous prepared directory aside and the new one into place, the
    output is missing: a signal there waits for the swap, so the new one is in place (the
    command still stops: exit 130 / 143), never neither, and nothing is left beside it."""
    out = tmp_path / "prep"
    argv = ["data", "prepare", "--input", str(world.conversations), "--tokenizer",
            str(world.target), "--out", str(out), "--eval-fraction", "0"]  # fmt: skip
    assert main([*argv, "--max-records", "3"]) == 0
    script = tmp_path / "swap.py"
    script.write_text(SIGNAL_IN_SWAP.format(signal=name))
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(script), *argv, "--overwrite"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == (130 if name == "SIGINT" else TERMINATED), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep", "swap.py"]
    assert len(PreparedDataset(out)) == 6  # the new one, whole
    assert main([*argv, "--overwrite"]) == 0


WRAPPED_INTERRUPT = textwrap.dedent(
    """
    import sys, time
    import dflash_trainer.formats.export as export
    from dflash_trainer.cli import main

    def reading(*args, **kwargs):  # as transformers' lazy imports do with a Ctrl-C in them
        try:
            print("reading", flush=True)
            time.sleep(30)
        except KeyboardInterrupt as e:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'") from None
    export.import_drafter = reading
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_an_interrupt_a_library_turned_into_its_own_error_is_still_an_interrupt(
    world: World, tmp_path: Path, name: str
) -> None:
    """Ctrl-C inside a library that catches it and raises an error of its own is reported
    as the interruption it was (exit 130 / 143), not as a problem with the input."""
    script = tmp_path / "wrapped.py"
    script.write_text(WRAPPED_INTERRUPT)
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    argv = ["import", str(world.export), "--out", str(tmp_path / "d")]
    proc = subprocess.Popen([sys.executable, str(script), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "reading"
        proc.send_signal(getattr(signal, name))
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    says = "terminated (SIGTERM)" if name == "SIGTERM" else "interrupted"
    assert proc.returncode == (TERMINATED if name == "SIGTERM" else 130), err
    assert f"dflash import: {says}" in err and "error" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wrapped.py"]
