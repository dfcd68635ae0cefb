"""Numbers on the command line pass the same gate as numbers in a config.

Every numeric flag of every command declares its type here, with its range, e.g.
`p.add_argument("--top-p", type=fraction(open_low=True))`. The check is config_fields'
own (`Rule` and `check_value`): finite, inside the range, an integer where a count is
meant. argparse turns the refusal into `argument --top-p: must be in (0, 1], got nan`
and exit status 2, before the command loads anything. tests/test_cli_numbers.py walks
every command's parser and fails on a numeric flag that is not declared here.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any

from dflash_trainer.config_fields import SEED_MAX, ConfigError, Rule, check_value

COUNT_MAX = 2**31 - 1
"""Counts and token lengths: beyond this a tensor index or a loop would overflow or never end."""


class CheckedNumber:
    """An argparse `type=` that parses an int or a float and checks its range."""

    def __init__(self, kind: type, rule: Rule, name: str) -> None:
        self.kind, self.rule, self.__name__ = kind, rule, name

    def __call__(self, text: str) -> Any:
        try:
            value: Any = int(text, 10) if self.kind is int else float(text)
        except ValueError:
            what = "an integer" if self.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if self.kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        try:
            check_value(value, self.rule, "value")
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None
        return value


def integer(lo: int = 0, hi: int = COUNT_MAX, why: str = "") -> Callable[[str], int]:
    return CheckedNumber(int, Rule(lo=lo, hi=hi, why=why), "integer")


def count(lo: int = 1, hi: int = COUNT_MAX) -> Callable[[str], int]:
    """A number of things (samples, tokens, rows): at least `lo`."""
    return integer(lo, hi)


def seed() -> Callable[[str], int]:
    return integer(0, SEED_MAX, "torch and numpy take a 64-bit seed")


def real(
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Callable[[str], float]:
    return CheckedNumber(float, Rule(lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open), "number")


def positive(hi: float = 1e9) -> Callable[[str], float]:
    """A physical quantity (GB, TFLOP/s, GB/s): more than 0."""
    return real(0.0, hi, lo_open=True)


def fraction(open_low: bool = False, open_high: bool = False) -> Callable[[str], float]:
    return real(0.0, 1.0, lo_open=open_low, hi_open=open_high)


def temperature() -> Callable[[str], float]:
    return real(0.0, 100.0)


def temperatures() -> Callable[[str], list[float]]:
    """Comma-separated temperatures ("0,1"), each through `temperature()`'s gate."""
    one = temperature()

    def parse(text: str) -> list[float]:
        return [one(t) for t in text.split(",")]

    parse.__name__ = "temperatures"
    return parse


def is_checked(type_: Any) -> bool:
    return isinstance(type_, CheckedNumber)


_DEVICE = re.compile(r"(cpu|mps|(cuda|xpu)(:[0-9]{1,4})?)")


def _check_present(name: str) -> None:
    """A GPU the machine lacks is said here, not later by a library as 'refused the input'."""
    import torch

    kind, _, index = name.partition(":")
    if kind == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(index or 0) >= have:
            raise argparse.ArgumentTypeError(
                f"{name!r}: this machine has {have} CUDA device(s) torch can use"
                + ("" if have else f" (torch {torch.__version__}); use cpu")
            )
    elif kind == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError("'mps': not available on this machine; use cpu")


def device(auto: bool = False) -> Callable[[str], str]:
    """A device name with its index in ASCII digits (`cuda:1`), or `auto` where the command
    picks: refused here, naming the flag, before torch turns `--device=-1` into a bug report."""

    def parse(text: str) -> str:
        if auto and text == "auto":
            return text
        if _DEVICE.fullmatch(text):
            _check_present(text)
            return text
        raise argparse.ArgumentTypeError(
            f"must be {'auto, ' if auto else ''}cpu, cuda, cuda:N or mps, got {text!r}"
        )

    parse.__name__ = "device"
    return parse
