"""What a `dflash` command does about its process environment: SIGTERM, a reader of its output
that went away, and a terminal that cannot show every character.

- SIGTERM (`kill`, a job scheduler's time limit, `timeout`) raises `Terminated`, a
  KeyboardInterrupt: the command ends the way Ctrl-C ends it, so its `finally` blocks remove
  the temporaries they made and release its locks, instead of dying with them in place.
  The trainer installs its own handler (a checkpoint before it stops) while it trains.
- stdout or stderr is a pipe whose reader is gone (`dflash ... | head -c1`): printing fails
  with EPIPE. Nothing a command prints is its output (outputs are files), so the stream is
  pointed at /dev/null and the command goes on: the export, the report, the prepared
  directory are still written whole, and no "Broken pipe" error stands for a disk problem.
- a character the terminal's encoding cannot show (a non-UTF-8 locale, a path in another
  script) is printed escaped (`\\xe9`) instead of failing the command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


class _Forgiving:
    """A text stream that, once its reader has gone (EPIPE), discards what it is given."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def _gone(self) -> None:
        self.broken = True
        # Python flushes the stream once more at exit: its descriptor goes to /dev/null so
        # that flush succeeds silently instead of printing "Exception ignored ...".
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _escaping(stream: Any) -> None:
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None:
        with contextlib.suppress(Exception):
            reconfigure(errors="backslashreplace")


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """The command's body runs with the SIGTERM handler and forgiving streams; the process
    state (handler, sys.stdout / sys.stderr) is put back afterwards (tests call main())."""
    old_out, old_err = sys.stdout, sys.stderr
    for stream in (old_out, old_err):
        _escaping(stream)
    if old_out is not None:
        sys.stdout = _Forgiving(old_out)
    if old_err is not None:
        sys.stderr = _Forgiving(old_err)
    previous = None
    in_main = threading.current_thread() is threading.main_thread()
    if in_main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        sys.stdout, sys.stderr = old_out, old_err
