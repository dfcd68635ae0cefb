"""Input files are what they claim: regular files, of bounded size once decompressed.

Every reader of a file the user names opens it here:

- only a regular file (or a link to one) is read. A FIFO would block the command forever, a
  device (`/dev/zero`) never ends, a socket is not data: each is refused before any read. The
  check is `stat` before `open` (opening some devices has effects) and again `fstat` on the
  descriptor opened without blocking, so a file swapped between the two is caught too;
- a gzip file may expand to at most `MAX_EXPANSION` times its size (and at least
  `MIN_EXPANSION_LIMIT` bytes): a decompression bomb is an error naming the file, not a full
  memory or disk. DFLASH_MAX_INPUT_BYTES raises the ceiling for a genuine, very repetitive file;
- `read_small_text` is for the little JSON/YAML files (configs, manifests, specs): a file of more
  than `max_bytes` is not one of them;
- `inside` keeps paths a file names (shards of a manifest) inside its directory.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
from pathlib import Path
from typing import IO, Any

from dflash_trainer.errors import DFlashError

MAX_EXPANSION = 200
"""Text compresses 3-20x; a ratio above 200 is a bomb or not a data file (gzip's limit is ~1032)."""
MIN_EXPANSION_LIMIT = 256 << 20
SMALL_FILE_BYTES = 64 << 20


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def kind_of(path: str | Path) -> str:
    """What `path` is (links followed): "a directory", "a FIFO (named pipe)", "a device", ..."""
    return _kind(os.stat(path).st_mode)


def _refuse(path: Path, mode: int, what: str) -> DFlashError:
    kind = _kind(mode)
    if kind == "a directory":
        return DFlashError(f"{what} {path} is a directory; name the file")
    return DFlashError(
        f"{what} {path} is {kind}, not a regular file; only regular files are read "
        "(copy the data into a file first)"
    )


def check_regular(path: str | Path, what: str = "input") -> os.stat_result:
    """The stat of `path` if it is a regular file (links followed), else a DFlashError."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise DFlashError(f"{what} {p} does not exist") from None
    except NotADirectoryError:
        raise DFlashError(f"{what} {p}: a part of the path is a file, not a directory") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(p, st.st_mode, what)
    return st


def open_regular(path: str | Path, what: str = "input") -> IO[bytes]:
    """A binary file object of the regular file `path` (see the module docstring)."""
    p = Path(path)
    check_regular(p, what)
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(p, st.st_mode, what)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def expansion_limit(compressed_bytes: int) -> int:
    env = os.environ.get("DFLASH_MAX_INPUT_BYTES", "").strip()
    if env.isdigit():
        return int(env)
    return max(MIN_EXPANSION_LIMIT, MAX_EXPANSION * compressed_bytes)


class _Bounded(io.RawIOBase):
    """A decompressing stream that refuses to yield more than `limit` bytes."""

    def __init__(self, inner: Any, path: Path, limit: int) -> None:
        self.inner, self.path, self.limit, self.done = inner, path, limit, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.done = int(self.inner.seek(offset, whence))  # gzip: a rewind decompresses again
        return self.done

    def tell(self) -> int:
        return self.done

    def readinto(self, b: Any) -> int:
        data = self.inner.read(len(b))
        self.done += len(data)
        if self.done > self.limit:
            raise DFlashError(
                f"{self.path} decompresses to more than {self.limit:,} bytes "
                f"({MAX_EXPANSION}x its size): a decompression bomb or not a data file; if it "
                "is genuine, decompress it yourself or set DFLASH_MAX_INPUT_BYTES"
            )
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.inner.close()
        super().close()


def open_input(path: str | Path, what: str = "input") -> IO[bytes]:
    """The (decompressed, for .gz) bytes of a regular file, as a buffered binary stream."""
    p = Path(path)
    raw = open_regular(p, what)
    if not p.name.endswith(".gz"):
        return raw
    size = os.fstat(raw.fileno()).st_size
    bounded = _Bounded(gzip.GzipFile(fileobj=raw, mode="rb"), p, expansion_limit(size))
    return io.BufferedReader(bounded, buffer_size=1 << 20)


def read_input_bytes(path: str | Path, what: str = "input") -> bytes:
    with open_input(path, what) as f:
        return f.read()


def read_small_bytes(path: str | Path, what: str, max_bytes: int = SMALL_FILE_BYTES) -> bytes:
    """A small file (config, manifest, spec) read whole; a larger one is refused."""
    p = Path(path)
    with open_regular(p, what) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise DFlashError(
            f"{what} {p} is larger than {max_bytes:,} bytes; that is not a {what} (check the path)"
        )
    return data


def read_small_text(path: str | Path, what: str, max_bytes: int = SMALL_FILE_BYTES) -> str:
    """`read_small_bytes` decoded as UTF-8 (an error names the line)."""
    p = Path(path)
    data = read_small_bytes(p, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DFlashError(
            f"{what} {p}: line {line} is not UTF-8 (byte {data[e.start]:#04x} at offset "
            f"{e.start}); save the file as UTF-8"
        ) from e


def inside(root: str | Path, name: str, what: str) -> Path:
    """`root / name` for a plain name that stays inside `root` (links resolved)."""
    base = Path(root)
    if not isinstance(name, str) or not name or name in (".", "..") or Path(name).name != name:
        raise DFlashError(f"{what}: {name!r} is not a plain name inside {base}")
    path = base / name
    real_root = base.resolve()
    if not path.resolve().is_relative_to(real_root):
        raise DFlashError(f"{what}: {path} leads outside {base} (a link?); copy the file in")
    return path


def check_model_dir(path: str | Path, what: str) -> None:
    """A local model or tokenizer directory holds only files and folders: a FIFO or a device
    among them would block (or never end) inside the library that reads it."""
    p = Path(path)
    if not p.is_dir():
        return
    for entry in sorted(p.iterdir())[:10_000]:
        try:
            mode = os.stat(entry).st_mode
        except OSError:
            continue  # a dangling link: the library names it if it needs it
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise _refuse(entry, mode, f"{what}: file")
