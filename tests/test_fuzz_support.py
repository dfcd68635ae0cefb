"""The fuzzers' per-example time limit: CPU time, a wall-clock backstop, a readable failure."""

from __future__ import annotations

import time

import pytest
from fuzz_support import time_limit


def _spin() -> None:
    with time_limit(1, "input"):
        while True:
            pass


def _hang() -> None:
    with time_limit(5, "input", wall_seconds=0.5):
        time.sleep(30)


def test_a_busy_example_fails_with_a_message_naming_the_cpu_limit() -> None:
    with pytest.raises(pytest.fail.Exception, match="one input took more than 1 s of CPU time"):
        _spin()


def test_waiting_uses_no_cpu_time_and_a_hang_meets_the_wall_clock_limit() -> None:
    with time_limit(1, "input", wall_seconds=10):
        time.sleep(1.3)  # past the CPU limit in wall time, far under it in CPU time
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"more than 0\.5 s of wall-clock time"):
        _hang()
    assert time.monotonic() - start < 5


def test_the_timers_are_off_after_the_block() -> None:
    with time_limit(1, "input"):
        pass
    deadline = time.process_time() + 1.5
    while time.process_time() < deadline:  # a stray CPU timer would fire in here
        pass
