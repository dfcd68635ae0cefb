"""What the two fuzzers (config and data) share: their hypothesis settings, a per-example time
limit and a report line that shows at the end of the module without `-s`."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
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
