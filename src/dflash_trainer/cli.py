"""`dflash <command>`: one entry point, each command implemented in its own module.

Only the chosen command's module is imported, so `dflash --help` stays fast and a
broken optional dependency of one command never breaks the others. The rest of the project
is imported inside the error boundary too: Ctrl-C while `dflash` starts is one line, not a
traceback (only the few standard modules imported here come before it).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from dflash_trainer import __version__
from dflash_trainer.cli_streams import exiting, finished, guarded, interruption


@dataclass(frozen=True)
class Command:
    module: str
    help: str
    add_arguments: str = "add_arguments"
    run: str = "run"


COMMANDS: dict[str, Command] = {
    "train": Command("dflash_trainer.train.cli", "train a drafter online against a frozen target"),
    "plan": Command(
        "dflash_trainer.plan.report",
        "FLOPs, time and memory per GPU of a run, before it starts",
        add_arguments="add_plan_arguments",
        run="run_plan",
    ),
    "doctor": Command(
        "dflash_trainer.doctor.run", "pre-flight checks of a config against its target"
    ),
    "eval": Command(
        "dflash_trainer.eval.evaluate", "speculative decoding: acceptance length and speedup"
    ),
    "export": Command(
        "dflash_trainer.formats.export", "write a drafter for vLLM / SGLang / z-lab / speculators"
    ),
    "import": Command(
        "dflash_trainer.formats.export",
        "read a published drafter (z-lab or speculators layout)",
        add_arguments="add_import_arguments",
        run="run_import",
    ),
    "data": Command("dflash_trainer.data.cli", "prepare, regenerate and inspect training data"),
    "lineage": Command(
        "dflash_trainer.lineage.cli", "what a drafter was trained on, continuation by continuation"
    ),
    "serve-check": Command(
        "dflash_trainer.serve.check",
        "serve the drafter in vLLM: its acceptance beside `dflash eval`'s, greedy equality",
    ),
    "plot": Command("dflash_trainer.train.plots", "write PNG training curves of a run directory"),
}


def _build_parser(selected: str | None) -> argparse.ArgumentParser:
    from dflash_trainer.cli_paths import expand_home

    parser = argparse.ArgumentParser(
        prog="dflash",
        description="Train DFlash speculative-decoding drafters and prove they work.",
    )
    parser.add_argument("--version", action="version", version=f"dflash-trainer {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an unexpected error (also DFLASH_DEBUG=1); "
        "may stand anywhere on the command line",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if name == selected:
            module = importlib.import_module(cmd.module)
            getattr(module, cmd.add_arguments)(p)
            p.set_defaults(_run=getattr(module, cmd.run))
            expand_home(p)  # `~` in every path flag alike (cli_paths.py)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, except that override words after an option are still overrides.

    argparse fills a `nargs="*"` positional once: in `--recipe R a=1 --dry-run b=2`
    the `b=2` is left over. For commands that take overrides those words join them,
    and all overrides are put back in command-line order (later wins).
    """
    for word in argv:
        flag, eq, value = word.partition("=")
        # argparse turns `--flag=--` into an empty list where one value was meant, which
        # every later check then misreads: refused here, for every flag at once.
        if flag.startswith("--") and eq and value == "--":
            parser.error(f"{flag}=--: give {flag} a value ('--' only ends the options)")
    from dflash_trainer.config_cli import in_command_line_order

    args, extra = parser.parse_known_args(argv)
    if not hasattr(args, "overrides"):
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args
    stray = [w for w in extra if w.startswith("-")]  # a word is an override (or its error)
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = in_command_line_order(argv, [*args.overrides, *extra])
    return args


def main(argv: list[str] | None = None) -> int:
    """`dflash ARGV` (sys.argv when None: the program itself, which then also guards its exit)."""
    status = _main(list(sys.argv[1:] if argv is None else argv))
    if argv is None:
        exiting(status)  # a signal during the interpreter's exit keeps the status (cli_streams)
    return status


def _main(argv: list[str]) -> int:
    # --debug is global and may stand anywhere before a `--`: taken out before parsing.
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end]
    argv = [a for i, a in enumerate(argv) if i >= end or a != "--debug"]
    selected = next((a for a in argv if not a.startswith("-")), None)
    command = selected if selected in COMMANDS else "(no command)"
    with guarded():  # signals, a closed output pipe, an unprintable character (cli_streams.py)
        try:
            from dflash_trainer.target.configs import remote_code_granted

            parser = _build_parser(selected if selected in COMMANDS else None)
            args = _parse(parser, argv)
            if args.command is None:
                parser.print_help()
                return 0
            run: Callable[[argparse.Namespace], int] = args._run
            # Repository code of a target runs only when the command line says so.
            with remote_code_granted(bool(getattr(args, "trust_remote_code", False))):
                status = int(run(args) or 0)
            finished()  # the command is done: a signal from here on does not fail it
            return status
        except (Exception, KeyboardInterrupt) as e:  # the one error boundary (cli_errors.py);
            from dflash_trainer.cli_errors import debug_requested, report

            # Whatever a Ctrl-C / SIGTERM raised into turned into (a library may wrap it in
            # its own error), the command was interrupted, and is reported so.
            return report(command, interruption() or e, debug_requested(debug))
        # SystemExit (argparse, --help) passes through


if __name__ == "__main__":
    sys.exit(main())
