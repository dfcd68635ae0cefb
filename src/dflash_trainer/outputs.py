"""The paths a command writes: checked before any work, and written by one process at a time.

Every command that writes a file or a directory the user names goes through here first:

- `output_file`: a file output names a file: not empty, `.` or `..`, not an existing
  directory, and no part of its parent is a file (the error says which, before a model is
  loaded or an hour of generation is spent);
- `check_not_input`: an output is never one of the command's inputs, nor inside an input
  directory (the next run would read the output back as input), nor a directory that holds an
  input (replacing it would delete the input);
- `writing`: the output is locked (dir_lock.py: a sibling lock file, released however the
  process ends) for as long as the command writes it, so a second command on the same output
  is refused naming the first, instead of both interleaving their records or one losing the
  other's update. A command's outermost lock spans all of its work (a command that writes an
  output along the way, like serve-check's export, holds its own report's lock around it): so
  when that body returns, the outputs are in place and the rest is shutdown, which a signal no
  longer turns into a failure (dir_lock.output_locked, cli_streams.finished).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from dflash_trainer.config_fields import URL
from dflash_trainer.dir_lock import output_locked
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import kind_of

F = TypeVar("F", bound=Callable[..., Any])


def _blocking_part(path: Path) -> Path | None:
    """The first existing ancestor of `path` that is not a directory, if any."""
    for parent in reversed(path.parents):
        if os.path.lexists(parent) and not parent.is_dir():
            return parent
    return None


def _not_url(text: str, flag: str) -> None:
    if URL.match(text):  # Path() would make s3://b/x a local directory named 's3:'
        raise DFlashError(f"{flag} {text!r} is a URL; this output is written to a local path only")


def output_file(path: str | Path, flag: str) -> Path:
    """`path` checked as a file to write (absolute); a DFlashError names what is wrong."""
    text = os.fspath(path)
    _not_url(text, flag)
    p = Path(os.path.abspath(text)) if text else Path()
    if not text or text.endswith(os.sep) or p.name in ("", ".", ".."):
        raise DFlashError(f"{flag} {text!r} names no file; give a file name, e.g. out.jsonl")
    if p.is_dir():
        raise DFlashError(f"{flag} {p} is a directory; give the name of a file to write")
    if os.path.islink(p) and not p.exists():
        raise DFlashError(f"{flag} {p} is a link to nothing ({os.readlink(p)}); remove it")
    if p.exists() and not p.is_file():
        # A FIFO blocks the open for ever, a device never ends when read back to resume, and
        # a file written beside and renamed over it would replace the device node itself.
        raise DFlashError(
            f"{flag} {p} is {kind_of(p)}, not a regular file; give the name of a file to write"
        )
    part = _blocking_part(p)
    if part is not None:
        raise DFlashError(
            f"{flag} {p}: {part} is a file, not a directory; fix the path (nothing was written)"
        )
    return p


def output_dir(path: str | Path, flag: str) -> Path:
    """`path` checked as a directory to write into or create (absolute)."""
    text = os.fspath(path)
    _not_url(text, flag)
    if not text:
        raise DFlashError(f"{flag} '' names no directory; give one, e.g. {flag} out")
    p = Path(os.path.abspath(text))
    if os.path.lexists(p) and not p.is_dir():
        what = "a link to nothing" if os.path.islink(p) else "a file"
        raise DFlashError(f"{flag} {p} is {what}, not a directory; give a directory")
    part = _blocking_part(p)
    if part is not None:
        raise DFlashError(f"{flag} {p}: {part} is a file, not a directory; fix the path")
    return p


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.abspath(path)))


def check_not_input(
    out: str | Path,
    flag: str,
    inputs: Iterable[str | Path | None] = (),
    data: Iterable[str | Path | None] = (),
    replaced_whole: bool = False,
) -> None:
    """Refuse an output that is one of `inputs` or `data`, that lies inside a `data` directory
    (data inputs are read recursively: the output would be read back as data), or, for a
    directory replaced whole (`replaced_whole`), that holds an input. Names that are not local
    paths (hub ids, `asset:` names) are skipped. An output named by a URL is refused."""
    _not_url(os.fspath(out), flag)
    o = _real(out)
    for given, is_data in [*((i, False) for i in inputs), *((d, True) for d in data)]:
        if given is None or not os.path.lexists(given):
            continue
        i = _real(given)
        if o == i:
            raise DFlashError(
                f"{flag} {out} is the input {given}; writing there would destroy the input: "
                "choose another path"
            )
        if is_data and i.is_dir() and o.is_relative_to(i):
            raise DFlashError(
                f"{flag} {out} lies inside the input directory {given}, which is read whole: "
                "the next run would read the output back as input; write it elsewhere"
            )
        if replaced_whole and i.is_relative_to(o):
            raise DFlashError(
                f"{flag} {out} holds the input {given}; replacing it would delete the input: "
                "choose another path"
            )


@contextmanager
def writing(out: str | Path, command: str, what: str) -> Iterator[None]:
    """Hold the lock of `out` (one writer at a time) for the body of the `with`."""
    with output_locked(out, command, what):
        yield


def locks_output(param: str, command: str, what: str) -> Callable[[F], F]:
    """Decorate a function that writes the output named by its argument `param`: it runs
    holding that output's lock (re-entrant: a CLI that locked it earlier holds it already)."""

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = signature.bind(*args, **kwargs).arguments[param]
            with writing(out, command, f"{what} {out}"):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
