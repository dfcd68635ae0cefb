"""One writer per output: a run directory or a prepared dataset is locked while a process writes it.

The lock is a file (`<dir>/.dflash-lock` for a run, `.<name>.dflash-lock` beside a prepared
directory, which is replaced whole) held with `flock`, so the kernel drops it when its process
ends, even by kill -9 or a lost machine on local disk. The file says who holds it: process id,
host, when it started, and the command. A second writer is refused with those.

A lock file whose `flock` is free but which still names a holder was left by a process that
ended without releasing it. On this host that process is checked: gone (or its id now belongs
to another program, by its start time) -> the lock is taken over, and that is said. On another
host nothing can be checked, so it is refused, naming the host and the file to delete once that
run is over. Where the file system has no `flock` (some network mounts) the same check of the
file's holder is the lock.

Locks are re-entrant within a process (the CLI takes one before its pre-flight checks, the
trainer takes it again), and released on every way out: `release` (the normal ends and errors)
unlinks the file while still holding it, and process exit closes it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trainer.atomic_dir import short_name
from dflash_trainer.cli_streams import critical, finished
from dflash_trainer.errors import DFlashError

Log = Callable[[str], None]
RUN_LOCK = ".dflash-lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _stderr(message: str) -> None:
    print(f"[dflash] {message}", file=sys.stderr, flush=True)


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of process `pid` (clock ticks since boot), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True


@dataclass
class _Held:
    fd: int
    count: int


_HELD: dict[str, _Held] = {}
"""Locks this process holds, by lock file path (re-entry counts)."""


@dataclass
class DirLock:
    """A held lock; `release()` once per `acquire`."""

    path: Path

    def release(self) -> None:
        key = str(self.path)
        held = _HELD.get(key)
        if held is None:
            return
        held.count -= 1
        if held.count > 0:
            return
        with critical():  # never the file gone but still held, or the count without the file
            del _HELD[key]
            try:
                self.path.unlink()  # while still holding it: a waiter re-checks the inode
            except OSError:
                pass
            os.close(held.fd)


def run_lock_path(run_dir: str | Path) -> Path:
    return Path(os.path.abspath(run_dir)) / RUN_LOCK


def output_lock_path(out: str | Path) -> Path:
    """The lock of a directory that is replaced whole: a sibling file, kept out of it."""
    out = Path(os.path.abspath(out))
    return out.parent / f".{short_name(out.name)}.dflash-lock"


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process (its lock file does not say which)"
    return (
        f"`{holder.get('command', '?')}` (process {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')}, since {holder.get('started', '?')})"
    )


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        data = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _open(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DFlashError(f"{path} is a symbolic link; delete it (it is a lock file)") from e
        from dflash_trainer.cli_errors import user_message

        raise DFlashError(f"cannot create the lock file {path}: {user_message(e)}") from e


def _stale_holder_alive(holder: dict[str, Any], path: Path, what: str) -> None:
    """Refuse when a lock file not held by flock names a holder that may still run."""
    pid, host = holder.get("pid"), holder.get("host")
    if host != socket.gethostname():
        raise DFlashError(
            f"{what} is locked by {_describe(holder)}, which this host cannot check; if that "
            f"process is over, delete {path} and run again"
        )
    if isinstance(pid, int) and pid != os.getpid() and _alive(pid):
        start = holder.get("proc_start")
        if start is None or start == _proc_start(pid):
            raise DFlashError(
                f"{what} is in use by {_describe(holder)}; wait for it to finish or stop it"
            )


def acquire(directory: str | Path, command: str, what: str, log: Log = _stderr) -> DirLock:
    """Lock `directory` (a run: its lock file inside; see `acquire_output` for the other kind).

    `what` names the directory in messages ("run directory runs/x").
    """
    return _acquire(run_lock_path(directory), command, what, log)


def acquire_output(out: str | Path, command: str, what: str, log: Log = _stderr) -> DirLock:
    """Lock a directory that is written whole (its lock file is a sibling)."""
    return _acquire(output_lock_path(out), command, what, log)


@contextmanager
def output_locked(out: str | Path, command: str, what: str, log: Log = _stderr) -> Iterator[None]:
    """`acquire_output` for the body of a `with`, released however it ends.

    The outermost lock of a command spans all of its work (outputs.py), so when its body
    returns the command's outputs are in place: what is left (releasing it, the summary) is
    shutdown, past the point of no return (cli_streams.finished)."""
    lock = acquire_output(out, command, what, log)
    try:
        yield
        if list(_HELD) == [str(lock.path)] and _HELD[str(lock.path)].count == 1:
            finished()
    finally:
        lock.release()


def _acquire(path: Path, command: str, what: str, log: Log) -> DirLock:
    key = str(path)
    if key in _HELD:
        _HELD[key].count += 1
        return DirLock(path)
    for _ in range(20):  # the file may be released (unlinked) between our open and flock
        fd = _open(path)
        try:
            locked = _flock(fd)
            if not locked:
                raise DFlashError(
                    f"{what} is in use by {_describe(_read_holder(fd))}; wait for it to "
                    f"finish or stop it, or write elsewhere (lock file {path})"
                )
            if _same_file(fd, path):
                _take(fd, path, command, what, log)
                _HELD[key] = _Held(fd, 1)
                return DirLock(path)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise DFlashError(f"could not lock {what}: {path} keeps being replaced; try again")


def _flock(fd: int) -> bool:
    """True if held now (or the file system has no flock: the holder check decides)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return True
        raise
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (fst.st_ino, fst.st_dev)


def _take(fd: int, path: Path, command: str, what: str, log: Log) -> None:
    """Write this process into the lock file, after checking what a previous holder left."""
    holder = _read_holder(fd)
    if holder is not None:
        _stale_holder_alive(holder, path, what)
        log(
            f"took over the lock of {what} from {_describe(holder)}, which ended without "
            "releasing it"
        )
    elif os.fstat(fd).st_size:
        log(f"took over the lock of {what}: its lock file {path} was unreadable")
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "proc_start": _proc_start(os.getpid()),
        "command": command,
    }
    data = json.dumps(me).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
