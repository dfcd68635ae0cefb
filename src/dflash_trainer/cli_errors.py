"""The error boundary of every `dflash` command: what the user sees when a command fails.

Three kinds of failure, told apart by what was raised and where:

- the project's own errors (`DFlashError`, `ConfigError`): their message already names the
  field or file and the fix;
- the environment and the user's files: an `OSError` (disk full, read-only file system, a
  name too long, a directory where a file belongs, no permission), a damaged safetensors
  file, or an error that transformers / tokenizers / huggingface_hub / safetensors / yaml
  raise from their own code while reading what the user named. These become one paragraph
  naming the file and what to do, exit status 2, like the project's own errors;
- anything else is a bug of this project: without `--debug` (or DFLASH_DEBUG=1) a short
  paragraph says so and how to see the traceback; with it, the traceback itself.

`about(...)` blocks (errors.py) add what was being read, so a library error names it.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from types import TracebackType

from dflash_trainer.cli_streams import Terminated
from dflash_trainer.config_fields import ConfigError
from dflash_trainer.errors import CONTEXT_ATTR, DFlashError

USER_ERROR = 2
"""Exit status of an error the user can fix (argparse's own, for a wrong flag, is 2 too)."""
INTERNAL_ERROR = 70
"""Exit status of a bug (EX_SOFTWARE): a fuzzer or a script tells it from a user error."""
INTERRUPTED = 130
TERMINATED = 143
"""128 + SIGTERM, what a shell reports for a process SIGTERM ended."""

# Libraries whose errors, raised from their own code, are about the input they were given.
_LIBRARIES = ("transformers", "tokenizers", "huggingface_hub", "safetensors", "yaml", "jinja2")

_OS_FIXES = {
    errno.ENOSPC: "the disk is full: free space there or write somewhere else",
    errno.EDQUOT: "the disk quota is used up: free space there or write somewhere else",
    errno.EROFS: "the file system is read-only: write somewhere else",
    errno.ENAMETOOLONG: "a name in the path is too long: use a shorter path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: fix the path",
    errno.EISDIR: "this is a directory where a file is expected: name a file",
    errno.EACCES: "permission denied: fix the permissions or use another path",
    errno.EPERM: "the operation is not permitted there: use another path",
    errno.ENOENT: "it does not exist: check the path",
    errno.ELOOP: "too many symbolic links (a loop?): give the real path",
    errno.EEXIST: "it already exists: remove it or choose another path",
    errno.ENOTEMPTY: "the directory is not empty: choose another path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) or read fewer at once",
    errno.EXDEV: "source and destination are on different file systems",
    errno.EINVAL: "the path or the operation is not valid there",
    errno.ENXIO: "no such device: give a regular file",
    errno.EIO: "an input/output error from the device: check the disk",
}


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get("DFLASH_DEBUG", "").strip() not in ("", "0", "false", "no")


def _context(e: BaseException) -> str:
    notes = getattr(e, CONTEXT_ATTR, None) or []
    return "".join(f" (while reading {n})" for n in notes)


def _first_line(e: BaseException, limit: int = 400) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _in_the_way(name: str | bytes | int | None) -> str | None:
    """Why EEXIST: creating a directory where something else (a file, a dead link) stands."""
    if name is None or isinstance(name, int):
        return None
    if os.path.islink(name) and not os.path.exists(name):
        return "it is a link to nothing: remove the link or give another path"
    if os.path.exists(name) and not os.path.isdir(name):
        return "it is a file where a directory is needed: move it or give another path"
    return None


def _os_message(e: OSError) -> str:
    names = [n for n in (e.filename, e.filename2) if n is not None]
    where = " -> ".join(repr(os.fsdecode(n)) for n in names) if names else "a file"
    what = e.strerror or _first_line(e)
    fix = _OS_FIXES.get(e.errno or -1, "check the path and the disk, then run the command again")
    if e.errno == errno.EEXIST:
        fix = _in_the_way(e.filename) or fix
    return f"{where}: {what}; {fix}"


def _frame_library(tb: TracebackType) -> str | None:
    parts = os.path.normpath(tb.tb_frame.f_code.co_filename).split(os.sep)
    if "dflash_trainer" in parts:
        return "ours"
    return next((lib for lib in _LIBRARIES if lib in parts), None)


def _library_of(tb: TracebackType | None) -> str | None:
    """The library whose code raised, if one of _LIBRARIES: the innermost frame of such a
    library with none of this project's frames below it. What the library called on its
    input may be what raised (torch making a tensor of the shape a config.json gave, json
    nested past the stack's depth): the library is still the one that met the input. A
    frame of ours below it is our code raising (a callback), never the library's."""
    found = None
    while tb is not None:
        lib = _frame_library(tb)
        if lib == "ours":
            found = None
        elif lib is not None:
            found = lib
        tb = tb.tb_next
    return found


def _is_safetensors_error(e: BaseException) -> bool:
    return type(e).__module__.startswith("safetensors") or type(e).__name__ == "SafetensorError"


def user_message(e: BaseException) -> str | None:
    """The paragraph for an error the user can fix, or None for a bug."""
    if isinstance(e, DFlashError | ConfigError):
        return str(e)
    if isinstance(e, OSError):  # the environment, never a bug of ours
        return (_os_message(e) if e.errno is not None else _first_line(e)) + _context(e)
    if _is_safetensors_error(e):
        return (
            f"a safetensors file is damaged or not safetensors{_context(e)}: {_first_line(e)}; "
            "replace it with an intact copy (export or download it again)"
        )
    if isinstance(e, ValueError) and "embedded null byte" in str(e):
        # The OS refuses a path holding NUL: it came from a value the user gave (a YAML
        # string, a flag set from a program), never from the tool's own names.
        return (
            f"a path or name holds a NUL byte{_context(e)}; remove it from the value given "
            "on the command line or in the config"
        )
    if isinstance(e, RuntimeError) and str(e).startswith("Symlink loop from "):
        # pathlib's own ELOOP before Python 3.13 (Path.resolve): the environment, not a bug.
        where = str(e).removeprefix("Symlink loop from ")
        return f"{where}: a symbolic link loop{_context(e)}; {_OS_FIXES[errno.ELOOP]}"
    if isinstance(e, UnicodeEncodeError) and (
        "surrogates not allowed" in str(e) or e.encoding.lower() not in ("utf-8", "utf8")
    ):
        # A name whose bytes are not UTF-8, or any non-ASCII name under a locale that is not
        # UTF-8 (LC_ALL=C with PYTHONUTF8=0), reaching a library that takes text names only.
        return (
            f"a path or name cannot be encoded for the library that opens it{_context(e)} "
            f"({_first_line(e)}): its bytes are not UTF-8, or the locale is not UTF-8; rename "
            "it with ASCII characters, or run under a UTF-8 locale (LANG=C.UTF-8)"
        )
    if isinstance(e, UnicodeDecodeError):
        return (
            f"a file is not UTF-8 text{_context(e)} ({_first_line(e)}); save it as UTF-8 "
            "or check that the path names the file you meant"
        )
    lib = _library_of(e.__traceback__)
    if lib is not None and isinstance(e, Exception):
        return (
            f"{lib} refused the input{_context(e)}: {type(e).__name__}: {_first_line(e)}. "
            "Check the model, tokenizer or file named on the command line (it may be damaged, "
            "of another kind, or need a newer library); --debug shows where it failed"
        )
    if isinstance(e, MemoryError) or (
        # torch's CPU allocator refuses with a RuntimeError, not a MemoryError
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    ):
        return (
            "out of memory (host RAM); use a smaller model, batch or input, or a machine "
            "with more memory"
        )
    return None


def report(command: str, e: BaseException, debug: bool) -> int:
    """Print the failure of `dflash <command>` and return the exit status."""
    if isinstance(e, Terminated):
        print(f"dflash {command}: terminated (SIGTERM)", file=sys.stderr)
        return TERMINATED
    if isinstance(e, KeyboardInterrupt):
        print(f"dflash {command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    message = user_message(e)
    if message is not None and not (debug and not isinstance(e, DFlashError | ConfigError)):
        print(f"dflash {command}: error: {message}", file=sys.stderr)
        return USER_ERROR
    if debug:
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        if message is not None:
            print(f"dflash {command}: error: {message}", file=sys.stderr)
            return USER_ERROR
        return INTERNAL_ERROR
    print(
        f"dflash {command}: internal error: {type(e).__name__}: {_first_line(e)}{_context(e)}. "
        "This is a bug in dflash-trainer, not in your input: run the command again with "
        "--debug (or DFLASH_DEBUG=1) to see the traceback, and report it",
        file=sys.stderr,
    )
    return INTERNAL_ERROR
