"""`~` in the paths given on the command line: expanded the same way for every flag.

A shell expands `~/x` only at the start of a word, so `--out ~/x` reaches the program expanded
but `--out=~/x`, a quoted `"~/x"` or a value written by a script does not. Each command used to
see these as it happened to treat them (one flag through `Path.expanduser`, the next as a
literal directory named `~`). Here, once, for the chosen command's parser: every flag and
positional that takes a string gets a leading `~` or `~user` expanded as argparse reads it
(paths, and names that may be paths: a model, a tokenizer; a value that is neither, a device
or a dtype, never starts with `~`). A flag whose value is free text (a note, a system prompt,
a config override) is declared with `type=text` and kept as written. Numbers and choices are
not touched. tests/test_hostile_paths.py walks every command's flags.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from dflash_trainer.config_fields import URL


def text(value: str) -> str:
    """The `type=` of a flag whose value is free text, not a path: kept as given."""
    return value


def path(value: str) -> str:
    """A path as given, with a leading `~` or `~user` expanded."""
    return os.path.expanduser(value)


def path_obj(value: str) -> Path:
    """`path` as a Path (the flags declared `type=Path`: local paths only). A URL is refused:
    Path would fold `s3://b/x` into a local directory named `s3:`."""
    if URL.match(value):
        raise argparse.ArgumentTypeError(f"{value!r} is a URL; this flag takes a local path")
    return Path(os.path.expanduser(value))


_EXPANDED = {None: path, str: path, Path: path_obj}
"""The types of string-valued flags, and the type each gets instead."""


def _takes_values(action: argparse.Action) -> bool:
    return action.nargs != 0 and not action.choices


def expand_home(parser: argparse.ArgumentParser) -> None:
    """Give every string-valued flag of `parser` (and of its subcommands) the `path` type."""
    for action in parser._actions:  # argparse keeps them there; it has no public list
        if isinstance(action, argparse._SubParsersAction):
            sub: Any
            for sub in action.choices.values():
                expand_home(sub)
        elif _takes_values(action) and action.type in _EXPANDED:
            action.type = _EXPANDED[action.type]
