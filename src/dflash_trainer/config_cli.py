"""The command-line half of the config: one way to name a config and override it.

Every command that takes a config (train, doctor, plan) declares its arguments here,
so they all accept the same forms: `--recipe NAME` or `--config FILE`, overrides as
positional `section.field=value` words and as `--set section.field=value`, applied in
command-line order, and `--trust-remote-code`, the only way to let a target's
repository code run (a config file alone cannot: see target/configs.py).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from typing import Any

from dflash_trainer.cli_paths import text
from dflash_trainer.config import Config, ConfigError, load_config

OVERRIDE_HELP = "dotted override section.field=value, e.g. training.lr=3e-4"


class _Overrides(argparse.Action):
    """Positional words and --set values go to one list, in the order they come."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items += list(values) if isinstance(values, list) else [values]
        setattr(namespace, self.dest, items)


def add_config_arguments(p: argparse.ArgumentParser, *, resume: bool = False) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--recipe", metavar="NAME", type=text, help="a bundled recipe, e.g. smollm2-135m-demo"
    )
    src.add_argument("--config", metavar="FILE", help="a YAML config file")
    if resume:
        src.add_argument(
            "--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint"
        )
    p.add_argument(
        "overrides",
        nargs="*",
        action=_Overrides,
        type=text,
        metavar="KEY=VALUE",
        help=OVERRIDE_HELP,
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action=_Overrides,
        type=text,
        metavar="KEY=VALUE",
        help="the same as a positional override (repeatable)",
    )
    add_trust_argument(p)
    p.set_defaults(overrides=[])


def add_trust_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a target with target.trust_remote_code: true run its repository's Python "
        "(a config file alone never does)",
    )


def in_command_line_order(argv: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """`overrides` sorted by where they appear in argv: argparse hands positional words
    that come after an option in a second batch, after the --set values."""
    pending = Counter(overrides)
    out: list[str] = []
    for word in argv:
        value = word[len("--set=") :] if word.startswith("--set=") else word
        if pending[value] > 0:
            pending[value] -= 1
            out.append(value)
    out += list(pending.elements())
    return out


def config_from_args(args: argparse.Namespace) -> Config:
    if not args.config and not args.recipe:
        raise ConfigError("give --config FILE or --recipe NAME")
    return load_config(recipe=args.recipe, config_file=args.config, overrides=args.overrides)
