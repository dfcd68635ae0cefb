"""What the fuzzers (config, data, command line, damaged artifacts) share: their hypothesis
settings, a per-example time limit, a report line that shows at the end of the module without
`-s`, and one command line run through `dflash`'s error boundary and classified."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

SECONDS_PER_EXAMPLE = 10
"""CPU seconds one example may use (a hang that waits instead is caught by the wall limit)."""
WALL_FACTOR = 12
FUZZ = settings(
    max_examples=300,
    deadline=None,  # time_limit below bounds each example; deadlines flake on shared cores
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


class Slow(BaseException):
    """Raised by the timers: not an Exception, so no code under test can swallow it."""


@contextmanager
def time_limit(seconds: int, what: str, wall_seconds: float | None = None) -> Iterator[None]:
    """Fail the example if its body uses more than `seconds` of CPU time, or runs longer than
    `wall_seconds` (WALL_FACTOR x `seconds`) however it spends them: never a hang.

    CPU time, because a wall-clock limit fired on cores shared with other jobs while the
    example itself was fine. The failure is a plain `pytest.fail` naming the limit, which
    hypothesis reports (with the example) like any failed assertion.
    """
    wall = float(wall_seconds if wall_seconds is not None else WALL_FACTOR * seconds)

    def over(kind: str, limit: float) -> Any:
        def handler(signum: int, frame: Any) -> None:
            raise Slow(f"one {what} took more than {limit:g} s of {kind} time")

        return handler

    old = {
        signal.SIGPROF: signal.signal(signal.SIGPROF, over("CPU", seconds)),
        signal.SIGALRM: signal.signal(signal.SIGALRM, over("wall-clock", wall)),
    }
    signal.setitimer(signal.ITIMER_PROF, seconds)
    signal.setitimer(signal.ITIMER_REAL, wall)
    try:
        yield
    except Slow as e:
        pytest.fail(str(e), pytrace=False)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def show(request: Any, line: str) -> None:
    """Write `line` on the terminal, past pytest's output capture (shown without -s too)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\n{line}")
    else:
        print(line)


@dataclass
class Outcome:
    """How one `dflash` command line ended (`run_cli`)."""

    rc: int | None
    """Exit status; None when it never returned (a hang, an escaped exception)."""
    text: str
    """stdout + stderr."""
    problem: str | None = None
    """None (clean), "hang", "escaped" (an exception past the error boundary), "traceback"
    (an internal error, exit 70, or a traceback printed) or "exit" (another exit status)."""
    usage_error: bool = False
    error: BaseException | None = None


def run_cli(argv: list[str], capsys: Any, wall_seconds: float = 20) -> Outcome:
    """Run `dflash ARGV` through `cli.main` within the time limit and say how it ended; never
    raises for the command's own failure (a fuzzer that counts them all goes on)."""
    from dflash_trainer import cli
    from dflash_trainer.cli_errors import INTERNAL_ERROR

    usage = False
    try:
        with time_limit(10, "command", wall_seconds=wall_seconds):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # argparse: a usage error (2) or --help (0)
                rc, usage = (e.code if isinstance(e.code, int) else 2), True
    except pytest.fail.Exception as e:
        return Outcome(None, _captured(capsys), "hang", error=e)
    except Exception as e:
        return Outcome(None, _captured(capsys), "escaped", error=e)
    text = _captured(capsys)
    if rc == INTERNAL_ERROR or "Traceback (most recent call last)" in text:
        return Outcome(rc, text, "traceback", usage)
    if rc not in (0, 1, 2, 130):
        return Outcome(rc, text, "exit", usage)
    return Outcome(rc, text, None, usage)


def _captured(capsys: Any) -> str:
    out = capsys.readouterr()
    return str(out.out + out.err)


def run_command(
    argv: list[str], capsys: Any, counts: Any, failures: list[str], wall_seconds: float = 20
) -> None:
    """Run `dflash ARGV` through `cli.main` and classify it in `counts`: clean (success, a
    usage error, a user error, a failed check), a traceback (an internal error, exit 70, or
    one that escaped) or a hang (over the time limit). A traceback or a hang fails the
    example, naming the command line."""
    counts["tried"] += 1
    out = run_cli(argv, capsys, wall_seconds)
    counts["usage_errors"] += out.usage_error
    if out.problem == "hang":
        counts["hangs"] += 1
        failures.append(f"hang: {argv}")
        assert out.error is not None
        raise out.error
    if out.problem == "escaped":
        counts["tracebacks"] += 1
        failures.append(f"escaped {type(out.error).__name__}: {argv}")
        assert out.error is not None
        raise out.error
    if out.problem == "traceback":
        counts["tracebacks"] += 1
        failures.append(f"{out.text.strip().splitlines()[-1][:300]}: {argv}")
        pytest.fail(f"internal error for {argv}:\n{out.text[-3000:]}")
    assert out.problem is None, (out.rc, argv, out.text[-2000:])
    counts["clean"] += 1
    counts[f"exit_{out.rc}"] += 1


def go_offline(monkeypatch: Any) -> None:
    """No example may reach the network: the hub and datasets answer from the local cache
    only (huggingface_hub reads HF_HUB_OFFLINE once, at import: its constant is set too)."""
    import huggingface_hub.constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
