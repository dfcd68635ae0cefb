"""What the two fuzzers (config and data) share: their hypothesis settings, a per-example time
limit and a report line that shows at the end of the module without `-s`."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, settings

SECONDS_PER_EXAMPLE = 10
FUZZ = settings(
    max_examples=300,
    deadline=None,  # time_limit below bounds each example; deadlines flake on shared cores
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


class Slow(BaseException):
    """Raised by the alarm: not an Exception, so no code under test can swallow it."""


@contextmanager
def time_limit(seconds: int, what: str) -> Iterator[None]:
    """Fail the example (raise `Slow`) if the body runs longer than `seconds`: never a hang."""

    def alarm(signum: int, frame: Any) -> None:
        raise Slow(f"one {what} took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def show(request: Any, line: str) -> None:
    """Write `line` on the terminal, past pytest's output capture (shown without -s too)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\n{line}")
    else:
        print(line)
