"""Every numeric flag of every command is checked like a config field, with the flag named."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from dflash_trainer import cli
from dflash_trainer import cli_numbers as num
from dflash_trainer.cli_numbers import is_checked


def command_parsers() -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    """(argv prefix, parser) of every command and subcommand."""
    for name in cli.COMMANDS:
        top = cli._build_parser(name)
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
        stack = [([name], sub.choices[name])]
        while stack:
            prefix, parser = stack.pop()
            yield prefix, parser
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    stack += [([*prefix, n], p) for n, p in action.choices.items()]


NUMERIC = [
    (prefix, action.option_strings[0], action.type)
    for prefix, parser in command_parsers()
    for action in parser._actions
    if action.option_strings and is_checked(action.type)
]


def test_no_numeric_flag_escapes_the_check():
    raw = [
        f"{' '.join(prefix)} {action.option_strings or action.dest}"
        for prefix, parser in command_parsers()
        for action in parser._actions
        if action.type in (int, float)
    ]
    assert raw == [], f"numeric flags without a range (use dflash_trainer.cli_numbers): {raw}"
    assert len(NUMERIC) >= 40  # plan, doctor, eval, train, data prepare/regenerate/...


@pytest.mark.parametrize(
    ("prefix", "flag", "kind"), NUMERIC, ids=lambda v: getattr(v, "__name__", str(v))
)
def test_hostile_numbers_are_refused_naming_the_flag(prefix, flag, kind, capsys):
    for bad in ("nan", "inf", "-inf", "1e400", "-1", "abc", "", "99999999999999999999999"):
        try:
            value = kind(bad)
        except argparse.ArgumentTypeError:
            pass
        else:  # only a value inside the range passes
            assert value == value and abs(value) < float("inf") and value >= 0, (flag, bad)
            continue
        with pytest.raises(SystemExit) as e:
            cli.main([*prefix, f"{flag}={bad}"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}" in err, err


def test_temperatures_is_a_list_each_through_the_temperature_gate():
    parse = num.temperatures()
    assert parse("0,1") == [0.0, 1.0] and parse("0.7") == [0.7]
    for bad in ("1,x", "0,-1", "nan", "1,,2", "101"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
