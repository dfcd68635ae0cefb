"""benchmarks/dflash2_vs_dflash.py refuses malformed drafter arguments with a usage error."""

from __future__ import annotations

from types import ModuleType

import pytest
from benchmark_scripts import load_benchmark


def _bench() -> ModuleType:
    return load_benchmark("dflash2_vs_dflash")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--drafter", "a"], "expected NAME=PATH"),
        (["--drafter", "=p"], "expected NAME=PATH"),
        (["--drafter", "a=p", "--also", "b=p"], "expected NAME=PATH:SAMPLING"),
        (["--drafter", "a=p", "--also", "b=p:hot"], "one of auto, greedy, sample"),
        (["--drafter", "a=p", "--also", "b=p:auto@0"], "must be in (0, 10]"),
        (["--drafter", "a=p", "--also", "b=p:auto@x"], "must be a number"),
        (["--drafter", "a=p", "--samples", "0"], "--samples"),
        (["--drafter", "a=p", "--decode", "fast"], "--decode"),
    ],
)
def test_malformed_arguments_are_usage_errors(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().main([*argv, "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_a_name_given_twice_is_refused_before_loading(tmp_path):
    argv = ["--drafter", "a=/nonexistent", "--also", "a=/nonexistent:greedy"]
    with pytest.raises(SystemExit, match="given twice"):
        _bench().main([*argv, "--out", str(tmp_path / "o")])


def test_also_reads_a_draft_temperature_scale():
    bench = _bench()
    assert bench._also("b=run:auto@0.65") == ("b", "run", "auto", 0.65)
    assert bench._also("b=/a:b/run:greedy") == ("b", "/a:b/run", "greedy", 1.0)
