"""What a `dflash` command does about its process environment: SIGTERM, a reader of its output
that went away, and a terminal that cannot show every character.

- SIGTERM (`kill`, a job scheduler's time limit, `timeout`) raises `Terminated`, a
  KeyboardInterrupt: the command ends the way Ctrl-C ends it, so its `finally` blocks remove
  the temporaries they made and release its locks, instead of dying with them in place.
  The trainer installs its own handler (a checkpoint before it stops) while it trains.
- a command past its point of no return (`finished()`: its outputs are in place, only its
  shutdown is left: releasing its locks, removing temporaries, printing its summary, the
  interpreter's exit) is not turned into a failure by SIGINT or SIGTERM: the signal is noted,
  said, and the command ends with its own status (a second one still stops it at once); the
  same once main() has returned and the interpreter exits (`exiting()`).
  Steps that must not be cut in half (swapping a directory into place, releasing a lock) run
  in `critical()`: a signal that comes meanwhile takes effect when the step is done.
- stdout or stderr is a pipe whose reader is gone (`dflash ... | head -c1`): printing fails
  with EPIPE. Nothing a command prints is its output (outputs are files), so the stream is
  pointed at /dev/null and the command goes on: the export, the report, the prepared
  directory are still written whole, and no "Broken pipe" error stands for a disk problem.
- a character the terminal's encoding cannot show (a non-UTF-8 locale, a path in another
  script) is printed escaped (`\\xe9`) instead of failing the command.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM."""


class _Signals:
    """What the handlers know: whether they are ours, the command's stage, what came."""

    installed = False
    critical = 0  # nesting of critical() in the main thread
    finished = False  # past the point of no return
    pending: list[int] = []  # noqa: RUF012 (one state per process, reset by guarded())
    exiting = False  # main() returned as the program: the interpreter is exiting
    raised: int | None = None  # the signal whose interruption the handler raised


def _interrupt(signum: int) -> KeyboardInterrupt:
    return Terminated(f"signal {signum}") if signum == signal.SIGTERM else KeyboardInterrupt()


def _on_signal(signum: int, frame: Any) -> None:
    state = _Signals
    if state.critical or (state.finished and not state.pending):
        state.pending.append(signum)  # said, and the command's own status kept
        return
    state.raised = signum
    raise _interrupt(signum)


def interruption() -> KeyboardInterrupt | None:
    """The interruption this command's handler raised (Ctrl-C, SIGTERM), if it raised one:
    what a command ends with after it is that, whatever a library turned it into."""
    return None if _Signals.raised is None else _interrupt(_Signals.raised)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """A step not to be cut in half by SIGINT / SIGTERM (they are handled in the main thread
    only): a signal that comes meanwhile is raised once it is done, unless the command is past
    its point of no return by then."""
    if not _in_main_thread():
        yield
        return
    _Signals.critical += 1
    try:
        yield
    finally:
        _Signals.critical -= 1
    if not _Signals.critical and _Signals.pending and not _Signals.finished:
        _Signals.raised = _Signals.pending.pop(0)
        raise _interrupt(_Signals.raised)


def finished() -> None:
    """The command's outputs are in place: from here SIGINT / SIGTERM no longer fail it."""
    if _Signals.installed and _in_main_thread():
        _Signals.finished = True


def exiting(status: int) -> None:
    """The command returned `status` and the interpreter exits: a signal now is not a
    traceback halfway through the exit callbacks (which stop servers, join helper processes):
    the first is ignored, a second ends the process at once with that status."""

    def leave(signum: int, frame: Any) -> None:
        _Signals.pending.append(signum)
        if len(_Signals.pending) < 2:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)

    if _in_main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, leave)
        _Signals.exiting = True


@atexit.register  # at import: it runs after the exit callbacks of every module imported later
def _ignore_from_here() -> None:
    """The last Python step of the exit: the interpreter then puts the signals' defaults back
    and tears itself down (torch's teardown takes a while), where SIGINT / SIGTERM would kill
    the process (status -2 / -15). Ignored instead, for that last stretch (kill -9 still
    ends it)."""
    if _Signals.exiting and _in_main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)


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
    """The command's body runs with the signal handlers and forgiving streams; the process
    state (handlers, sys.stdout / sys.stderr) is put back afterwards (tests call main())."""
    old_out, old_err = sys.stdout, sys.stderr
    for stream in (old_out, old_err):
        _escaping(stream)
    if old_out is not None:
        sys.stdout = _Forgiving(old_out)
    if old_err is not None:
        sys.stderr = _Forgiving(old_err)
    previous = _install() if _in_main_thread() else {}
    try:
        yield
    finally:
        if _Signals.finished and _Signals.pending:
            names = ", ".join(signal.Signals(n).name for n in _Signals.pending)
            print(f"dflash: {names} came after the outputs were written; they are complete, "
                  "the command finished", file=sys.stderr)  # fmt: skip
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _reset(installed=False)
        sys.stdout, sys.stderr = old_out, old_err


def _reset(installed: bool) -> None:
    _Signals.installed, _Signals.critical, _Signals.finished = installed, 0, False
    _Signals.pending, _Signals.raised = [], None


def _install() -> dict[int, Any]:
    """Our handler for SIGTERM and SIGINT where they have Python's defaults (a caller that set
    its own keeps it); the handlers it replaced."""
    previous: dict[int, Any] = {}
    for signum, default in (
        (signal.SIGTERM, signal.SIG_DFL),
        (signal.SIGINT, signal.default_int_handler),
    ):
        if signal.getsignal(signum) == default:
            previous[signum] = signal.signal(signum, _on_signal)
    _reset(installed=bool(previous))
    return previous
