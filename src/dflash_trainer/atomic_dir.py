"""Directories written whole or not at all: the one way this tool writes a directory output.

`atomic_directory(final)` hands out a sibling temporary directory named
`.<name>.tmp-<host>-<pid>`; when the body returns, every file in it is fsynced and it is renamed
to `final` (an existing `final` is first renamed aside to `.<name>.old-<host>-<pid>`, then
removed). If the body raises, the temporary directory is removed. So a reader of `final` sees
the previous complete directory or the new complete one, never a half-written one, even if the
writer is killed with SIGKILL or the machine loses power.

A killed writer cannot clean up after itself, so its temporary directory stays. The name says
whose it is, and a marker file inside (`MARKER`, naming the tool, the host and the process) says
that this tool made it: `remove_stale` (called on entry, and by the checkpointer for its whole
directory) removes those whose process is gone on this host, saying so, and leaves alone,
saying so, those of another host (a shared file system: that process may still be writing). A
process id that a new process reuses after a restart is also taken as gone unless this process
is writing that directory right now. One holding nothing, or only a marker cut short (a writer
killed while creating it), is removed too: there is nothing in it to lose. A directory with a
name like ours and anything else in it but no matching marker (another program's, or one copied
by hand) is never deleted: it is named, and left to the user. `write_file_atomic` writes each
file in a marked temporary directory of its own, so what a killed writer of a file leaves is
known to be ours the same way, and removed by the next write of that file.
The marker is taken out of the temporary directory just before it is published, so outputs never
hold it; a `.old-` directory gets one as soon as it has been moved aside.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_trainer.cli_streams import critical
from dflash_trainer.errors import DFlashError

Log = Callable[[str], None]

# `.<name>.tmp-<host>-<pid>` or `.<name>.old-<host>-<pid>` (a directory written or replaced),
# `.<name>.tmp.<8 hex>-<host>-<pid>` (a file written); the host has no `-` (see _host).
_TEMP = re.compile(
    r"^\.(?P<name>.+)\.(?P<kind>tmp|old)(?:\.[0-9a-f]{8})?-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)$"
)
MARKER = ".dflash-temp.json"
"""Inside every temporary directory this tool makes: {"tool", "host", "pid"} of its writer."""
_TOOL = "dflash-trainer"
_ACTIVE: set[Path] = set()
"""The temporary directories this process is writing now (never stale, whatever the pid)."""


def _umask() -> int:
    # Read once, at import: setting and restoring it later would open a window in which
    # another thread (checkpoints are written beside training) creates files without it.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _umask()
"""The process's umask: files this tool creates with an owner-only mode get 0o666 & ~UMASK."""


def _stderr(message: str) -> None:
    print(f"dflash: {message}", file=sys.stderr)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


_LONG_NAME = 150
"""Bytes of a name kept whole in a temporary name; a longer one is cut and hashed, so that the
temporary name stays within the file system's 255 bytes whenever the final name does (the
longest, a file's `.<name>.tmp.<8>-<host>-<pid>`, with a 64-byte host and a 7-digit pid)."""


def short_name(name: str) -> str:
    """`name`, or for a long one its first bytes and a hash (see _LONG_NAME)."""
    raw = os.fsencode(name)
    if len(raw) <= _LONG_NAME:
        return name
    return f"{os.fsdecode(raw[:_LONG_NAME])}~{hashlib.sha256(raw).hexdigest()[:12]}"


def temp_name(name: str, kind: str = "tmp") -> str:
    """The sibling name this process uses while writing (`tmp`) or replacing (`old`) `name`."""
    return f".{short_name(name)}.{kind}-{_host()}-{os.getpid()}"


def _write_marker(d: Path) -> None:
    (d / MARKER).write_text(
        json.dumps({"tool": _TOOL, "host": _host(), "pid": os.getpid()}), encoding="utf-8"
    )


def _marked(d: Path, host: str, pid: int) -> bool:
    """Whether `d` holds this tool's marker naming the writer its directory name names."""
    marker = d / MARKER
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 4096:
            return False
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data == {"tool": _TOOL, "host": host, "pid": pid}


def _remove_if_bare(d: Path) -> bool:
    """Remove `d` if it holds nothing, or only a marker cut short (not JSON): what a writer
    killed between creating the directory and finishing its marker leaves. Nothing else is
    in it, so nothing of anyone's is lost; rmdir itself refuses once anything appears."""
    marker = d / MARKER
    try:
        names = os.listdir(d)
        if names == [MARKER]:
            if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 4096:
                return False
            try:
                json.loads(marker.read_bytes())
                return False  # a whole marker naming another writer: not known to be ours
            except ValueError:
                marker.unlink()
        elif names:
            return False
        os.rmdir(d)
    except OSError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OverflowError:
        return False
    return True


def remove_stale(parent: Path, name: str | None = None, log: Log = _stderr) -> list[Path]:
    """Remove the temporary directories of writers that were killed (of `name`, or any name).

    Returns the removed paths. Only directories named by `temp_name` (or `write_file_atomic`)
    whose writer is gone on this host are removed, and only when they hold this tool's marker
    naming that writer, or nothing but a marker cut short, or nothing at all; a look-alike
    holding anything else is named and kept.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m is None or (name is not None and m["name"] != short_name(name)):
            continue
        path = Path(entry.path)
        if not entry.is_dir(follow_symlinks=False) or path in _ACTIVE:
            continue
        pid = int(m["pid"])
        if m["host"] != _host():
            log(f"left {path} alone: written by process {pid} on host {m['host']}, which may "
                "still be running; delete it yourself once no run writes there")  # fmt: skip
            continue
        if pid != os.getpid() and _alive(pid):
            continue  # another writer on this host, at work right now
        if _marked(path, m["host"], pid):
            shutil.rmtree(path, ignore_errors=True)
        elif not _remove_if_bare(path):
            log(f"left {path} alone: named like a temporary directory of this tool but without "
                f"its marker ({MARKER}), so not known to be one; delete it yourself if it is "
                "not needed")  # fmt: skip
            continue
        what = "an interrupted write" if m["kind"] == "tmp" else "an interrupted replacement"
        log(f"removed {path}, left by {what} (process {pid} is gone)")
        removed.append(path)
    return removed


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (files first, then their directories)."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_path(Path(dirpath))


def fsync_path(path: Path) -> None:
    """fsync a file (an error is raised: its data may not be on disk) or a directory (as far
    as the file system allows: some cannot open or fsync directories, and the files in it
    got their own fsync)."""
    is_dir = path.is_dir()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if is_dir:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not is_dir:
            raise
    finally:
        os.close(fd)


def check_replaceable(final: Path, ours: Callable[[str], bool], what: str) -> None:
    """Refuse to replace `final` unless every entry in it is one this tool writes there.

    `final` may be absent or an empty directory; a file, or a directory holding anything
    `ours` does not recognise, is an error that names the entries and deletes nothing.
    """
    if final.is_symlink():  # replacing would replace the link, and leave its target as it is
        raise DFlashError(f"{final} is a symbolic link; give the directory it points to")
    if not final.exists():
        return
    if not final.is_dir():
        raise DFlashError(
            f"{final} exists and is not a directory; give a directory path for {what}"
        )
    stray = sorted(p.name for p in final.iterdir() if not ours(p.name))
    if stray:
        shown = ", ".join(stray[:8]) + (f" and {len(stray) - 8} more" if len(stray) > 8 else "")
        raise DFlashError(
            f"{final} also holds files that are not part of {what} ({shown}); nothing was "
            "deleted: move them away or choose another directory"
        )


@contextmanager
def atomic_directory(
    final: str | Path, replace: bool = False, log: Log = _stderr
) -> Iterator[Path]:
    """Yield an empty temporary sibling of `final`; publish it as `final` when the body returns.

    `replace`: an existing `final` (checked by the caller to be replaceable) is swapped out;
    without it, an existing non-empty `final` is an error. The body must not keep files open.
    """
    final = Path(os.path.abspath(final))  # `.` and `..` have no name to rename
    if final.is_symlink():  # publishing renames over the link itself: the user's link is lost
        what = "a symbolic link" if final.exists() else "a link to nothing (or a link loop)"
        raise DFlashError(
            f"{final} is {what}; the directory is written in its place, which would remove "
            "the link: give the real path of the directory, or remove the link"
        )
    cwd = Path(os.path.realpath(os.curdir))
    if Path(os.path.realpath(final)) in (cwd, *cwd.parents):  # (a link loop: no error)
        raise DFlashError(f"{final} is the current directory or holds it; write to a new directory")
    parent = final.parent
    remove_stale(parent, final.name, log)
    tmp = parent / temp_name(final.name)
    if tmp.exists() or tmp.is_symlink():  # kept by remove_stale: not known to be ours
        raise DFlashError(
            f"{tmp} is in the way of writing {final} and is not known to be a temporary "
            "directory of this tool (no marker); move it away or delete it"
        )
    _make_temp_dir(tmp, final, parents=True)
    try:
        yield tmp
        (tmp / MARKER).unlink()  # published outputs never hold it
        fsync_tree(tmp)
        _publish(tmp, final, replace)
    finally:
        _ACTIVE.discard(tmp)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, final: Path, replace: bool) -> None:
    # Between moving the previous directory aside and the new one into place, `final` is
    # missing: Ctrl-C or SIGTERM there would leave neither. They wait until it is done.
    with critical():
        _swap(tmp, final, replace)


def _swap(tmp: Path, final: Path, replace: bool) -> None:
    old = None
    if final.exists() or final.is_symlink():
        if not replace and not (final.is_dir() and not any(final.iterdir())):
            raise DFlashError(f"{final} appeared while it was being written; nothing replaced")
        if not final.is_symlink() and not final.is_dir():  # a file, a FIFO: not an output
            raise DFlashError(
                f"{final} is in the way of writing a directory there and is not one (a file "
                "this tool did not write); nothing was replaced: move it away"
            )
        old = final.parent / temp_name(final.name, "old")
        _ACTIVE.add(old)
        os.replace(final, old)  # a symbolic link is moved as a link: its target stays
        if not old.is_symlink():
            _write_marker(old)  # a kill from here on leaves it to remove_stale
    try:
        os.replace(tmp, final)
    except OSError:
        if old is not None:  # put the previous directory back: never lose both
            os.replace(old, final)
            _ACTIVE.discard(old)
        raise
    fsync_path(final.parent)
    if old is not None:
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
        _ACTIVE.discard(old)


def write_file_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write the file `path` whole or not at all (text as UTF-8, whatever the locale; a path
    quoted in it whose bytes are not UTF-8 is written escaped, `\\udcff`, so the file stays
    UTF-8 that its readers can read).

    The bytes go to a new file (created exclusively, so never through a link or over another
    file) in a new temporary sibling directory (`.<name>.tmp.<random>-<host>-<pid>`, holding
    the marker of this tool, like `atomic_directory`'s), are fsynced and renamed over `path`:
    a reader sees the previous file or the new one, never part of one. Any failure (a full
    disk, Ctrl-C, SIGTERM through the CLI's handler) removes the temporary; only SIGKILL or a
    lost machine can leave it, hidden, and never at `path`: the next write of `path` removes
    it once its process is gone (`remove_stale`). A link at `path` is replaced, never written
    through: the file it points to stays as it was.
    """
    final = Path(path)
    if not final.name or final.name in (".", ".."):
        raise DFlashError(f"{os.fspath(path)!r} names no file; give a file name to write")
    if final.is_dir():
        raise DFlashError(f"{final} is a directory; give the name of a file to write")
    if final.exists() and not final.is_symlink() and not final.is_file():
        # A FIFO, a device node, a socket: the rename would replace the node itself.
        raise DFlashError(f"{final} is not a regular file; give the name of a file to write")
    raw = data.encode("utf-8", "backslashreplace") if isinstance(data, str) else data
    with staged_file(final) as content:
        # Created here, exclusively, never through a link; its mode follows the umask.
        fd = os.open(content, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(content, final)
    fsync_path(final.parent)
    return final


@contextmanager
def staged_file(final: Path) -> Iterator[Path]:
    """A new path to write the next bytes of the file `final` to, for a writer that streams
    them (`write_file_atomic` for bytes at hand): it lies in a marked temporary directory of
    its own beside `final`, removed on the way out of the block, so the caller renames it over
    `final` (os.replace) inside the block once it is written and fsynced. What a killed
    writer of `final` left is removed first."""
    remove_stale(final.parent, final.name)
    stage = _file_stage(final)
    try:
        yield stage / "content"
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # the marker (and the bytes, on a failure)
        _ACTIVE.discard(stage)


def _make_temp_dir(tmp: Path, final: Path, parents: bool = False) -> None:
    """Create the temporary directory `tmp` (for writing `final`; its parents too with
    `parents`) holding this tool's marker. It is known to be this process's before it exists:
    a sweep by another thread (the checkpointer's) never takes it, empty, for a dead writer's."""
    _ACTIVE.add(tmp)
    made = False
    try:
        if parents:
            tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        made = True
        _write_marker(tmp)
    except BaseException as e:
        _ACTIVE.discard(tmp)
        if made:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, FileExistsError) or not isinstance(e, OSError):
            raise
        raise DFlashError(f"cannot create {tmp} to write {final}: {e.strerror or e}") from e


def _file_stage(final: Path) -> Path:
    """A new marked temporary directory beside `final` for `write_file_atomic`: named after
    `final`, this process and a random part (several threads may write one name)."""
    base = temp_name(final.name)
    head, _, tail = base.partition(f".tmp-{_host()}-")
    for _ in range(100):
        stage = final.parent / f"{head}.tmp.{secrets.token_hex(4)}-{_host()}-{tail}"
        try:
            _make_temp_dir(stage, final)
            return stage
        except FileExistsError:
            continue
    raise DFlashError(f"cannot create a temporary directory beside {final}: names all taken")


def save_png(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    """A matplotlib figure as a PNG at `path`, written whole or not at all (a figure saved to
    its final name directly is a truncated image there if the process dies while saving)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return write_file_atomic(path, buf.getvalue())
