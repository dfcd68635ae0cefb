"""The one wrapper between the data readers and whatever an input file throws at them.

Every reader (`formats.read_records`, `sources.read_source`, the eval files of decontamination)
goes through these functions, which decide what a failure means:

- record-level: anything raised while decoding or normalising one record becomes a `Skip`
  whose reason is counted in the read report, and the read goes on. A `Skip` a normaliser
  raised keeps its reason; a lone surrogate (`\\udc80` escapes, or bytes that are not UTF-8)
  is `bad_utf8`; nesting deeper than the JSON decoder's recursion limit is `too_deep`; a value
  `json` refuses (a number of more than 4300 digits) is `bad_json`; any other exception is
  `record_error`, with its type in the report's `errors`: the run survives it, the report shows it.
- file-level: the file cannot be opened or read to its end (missing, a directory, no
  permission, a truncated or damaged gzip stream, UTF-16/UTF-32 text): a `DFlashError` naming
  the file and the fix. A gzip stream is checked only at its end, so what came before the
  damage cannot be trusted either; the outputs are atomic (atomic_dir), so nothing is written.
"""

from __future__ import annotations

import codecs
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from dflash_trainer.data.records import Skip
from dflash_trainer.errors import DFlashError

T = TypeVar("T")

FILE_ERRORS = (OSError, EOFError, zlib.error)
"""What reading a file raises when the file, not one record, is the problem (BadGzipFile and
the other I/O errors are OSErrors; a truncated gzip stream is an EOFError)."""

# UTF-32 first: its little-endian mark starts with UTF-16's.
_WIDE_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)


class BadValue:
    """An undecodable value (a damaged line or region): counted under `reason`, not raised."""

    def __init__(self, nbytes: int, reason: str = "bad_json") -> None:
        self.nbytes = nbytes
        self.reason = reason


def nbytes(text: str) -> int:
    """Bytes of `text` as read (undecodable bytes come back as surrogate escapes)."""
    try:
        return len(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        return len(text.encode("utf-8", "surrogatepass"))


def skip_for(exc: Exception) -> Skip:
    """The skip reason of an exception raised by one record."""
    if isinstance(exc, Skip):
        return exc
    if isinstance(exc, UnicodeError):
        return Skip("bad_utf8")
    if isinstance(exc, RecursionError):
        return Skip("too_deep")
    return Skip("record_error", type(exc).__name__)


def guard_record(fn: Callable[[], T]) -> T | Skip:
    """`fn()` for one record, or the `Skip` its exception means (see the module docstring)."""
    try:
        return fn()
    except (DFlashError, MemoryError):
        raise  # a problem of the run (or the machine), not of this record
    except Exception as e:
        return skip_for(e)


def decode_json(text: str) -> Any:
    """One JSON value, or a `BadValue` saying why it does not decode."""
    try:
        return json.loads(text)
    except RecursionError:
        return BadValue(nbytes(text), "too_deep")
    except ValueError:  # JSONDecodeError, and the digit limit of int()
        return BadValue(nbytes(text), "bad_json")


def check_bom(head: bytes, path: Path) -> int:
    """Bytes of a UTF-8 byte-order mark to skip; a UTF-16/32 file is a clear error."""
    for bom, name in _WIDE_BOMS:
        if head.startswith(bom):
            raise DFlashError(
                f"{path} is {name} text; the readers take UTF-8: convert it, e.g. "
                f"`iconv -f {name} -t UTF-8 {path.name} > {path.stem}.utf8{path.suffix}`"
            )
    return len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0


def decode_text(data: bytes, path: Path) -> str:
    """A whole file's text. Invalid UTF-8 bytes become surrogate escapes, so that they damage
    only the record holding them (`bad_utf8`), never the file."""
    return data[check_bom(data[:4], path) :].decode("utf-8", errors="surrogateescape")


def file_error(path: Path, exc: BaseException) -> DFlashError:
    """The DFlashError a file-level failure of `path` becomes."""
    if isinstance(exc, FileNotFoundError):
        return DFlashError(f"{path} does not exist (it may have been moved while reading)")
    if isinstance(exc, IsADirectoryError):
        return DFlashError(f"{path} is a directory; name the file, or the folder as the input")
    if isinstance(exc, EOFError | zlib.error) or path.name.endswith(".gz"):
        return DFlashError(
            f"{path}: truncated or damaged gzip stream ({exc}); the file is incomplete, "
            "download or copy it again"
        )
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return DFlashError(f"cannot read {path}: {reason}")


def guard_file(path: Path, values: Iterator[T]) -> Iterator[T]:
    """`values`, read from `path`, with file-level failures turned into a DFlashError."""
    try:
        yield from values
    except FILE_ERRORS as e:
        raise file_error(path, e) from e


def read_file_bytes(path: Path) -> bytes:
    """The file's (decompressed) bytes; any failure is a DFlashError naming the file."""
    from dflash_trainer.input_files import read_input_bytes

    try:
        return read_input_bytes(path)
    except FILE_ERRORS as e:
        raise file_error(path, e) from e
