"""Property-based fuzzing of every command's flags: no traceback, no hang.

Every command and data subcommand is taken from the real parser (a new flag is fuzzed
without touching this file). Each example is a command, the few arguments that get it
past its required ones, and 1-4 of its flags with hostile values: NaN, inf, negative,
huge and empty numbers, text with control and bidi characters, and paths to a directory,
a FIFO, a device, a dangling link, a link loop, nothing, a name too long, a file used as
a directory. The command runs through `cli.main`, the one error boundary: it may
succeed or refuse (argparse's exit 2, a user error's 2, doctor's failed check 1), but an
internal error (exit 70, what a bug becomes there) or a traceback on stderr fails the
example, and so does an example that runs over its time limit (a FIFO that blocks).

The hub is offline and the required path arguments come from the hostile pool, so no
example downloads a model or trains one: what is fuzzed is everything before that.
Examples are derandomized; counts are printed at the end of the module and written to
<pytest basetemp>/cli_fuzz_counts.json.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzz_support import FUZZ, go_offline, run_command, show
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli_numbers import command_parsers

COUNTS: Counter[str] = Counter()
FAILURES: list[str] = []
WALL_SECONDS = 20

# Flags left out, and why: --gpus of train re-executes the command under torchrun (a new
# process tree, by design); --help and --version exit before anything runs.
SKIP = {("train", "--gpus"), ("*", "-h"), ("*", "--help"), ("*", "--version")}

NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1", "0.5", "1e400", "-0", "9" * 40, "", "0x10"]
PLAIN = ["1", "2", "0.5", "8", "0"]
TEXT = ["", " ", "x", "é\u202e\u0000", "a" * 5000, "--", "-x", "gsm8k", "asset:nope", "hf:a/b"]


def hostile_paths(root: Path) -> list[str]:
    """Paths that are not what a command expects, each made for real under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "dir").mkdir(exist_ok=True)
    fifo = root / "fifo.jsonl"
    if not fifo.exists():
        os.mkfifo(fifo)
    (root / "empty.jsonl").write_bytes(b"")
    (root / "garbage.yaml").write_bytes(b"\xff\xfe\x00garbage\x00" * 64)
    (root / "file").write_text("x")
    for name, target in (("dangling", "nowhere"), ("loop", "loop"), ("todir", "dir")):
        if not (root / name).is_symlink():
            (root / name).symlink_to(root / target)
    return [
        str(root / "dir"),
        str(fifo),
        str(root / "empty.jsonl"),
        str(root / "garbage.yaml"),
        str(root / "dangling"),
        str(root / "loop"),
        str(root / "todir"),
        str(root / "nothing" / "here"),
        str(root / "file" / "below-a-file"),
        str(root / ("n" * 300)),
        "/dev/zero",
    ]


def _flags(parser: argparse.ArgumentParser, command: str) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings
        and (command, a.option_strings[0]) not in SKIP
        and ("*", a.option_strings[0]) not in SKIP
    ]


def _base(prefix: list[str], path: str, tmp: Path) -> list[str]:
    """Arguments that get each command past its required ones (a path from the pool where
    a command reads one, so that nothing heavy is ever loaded)."""
    out = str(tmp / "out")
    return {
        "train": ["--config", path],
        "plan": ["--recipe", "qwen3.6-27b"],
        "doctor": ["--recipe", "qwen3.6-27b", "--no-tokenizer"],
        "eval": ["--drafter", path],
        "export": [path, "--to", "zlab", out],
        "import": [path],
        "plot": [path],
        "data prepare": ["--input", path, "--out", out],
        "data regenerate": ["--input", path, "--out", out],
        "data synthesize": ["--model", path, "--out", out, "--n", "2"],
        "data prompts": ["--sources", path, "--out", out],
        "data stats": [path],
        "lineage show": [path],
        "lineage verify": [path],
        "lineage add-eval": [path, path],
        "lineage init": [path, "--steps", "1"],
        "serve-check": ["--drafter", path],
    }.get(" ".join(prefix), [])


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("hostile")
    return root, hostile_paths(root)


@pytest.fixture(scope="module", autouse=True)
def report_counts(request, tmp_path_factory) -> Iterator[None]:
    yield
    out = tmp_path_factory.getbasetemp() / "cli_fuzz_counts.json"
    counts = {k: COUNTS[k] for k in ("tried", "clean", "tracebacks", "hangs")}
    counts["of which"] = {k: v for k, v in sorted(COUNTS.items()) if k not in counts}
    out.write_text(json.dumps({**counts, "failures": FAILURES[:20]}, indent=1))
    show(request, f"cli fuzz: {json.dumps(counts)} ({out})")


PARSERS = [(p, parser) for p, parser in command_parsers() if not parser._subparsers]


@st.composite
def invocations(draw: st.DrawFn, paths: list[str], tmp: Path) -> list[str]:
    prefix, parser = draw(st.sampled_from(PARSERS))
    argv = [*prefix, *_base(prefix, draw(st.sampled_from(paths)), tmp)]
    flags = _flags(parser, prefix[0])
    chosen = draw(st.lists(st.sampled_from(flags), min_size=1, max_size=4)) if flags else []
    for action in chosen:  # a command may have no flags beyond its positionals
        flag = action.option_strings[-1]
        if action.nargs == 0:
            argv.append(flag)
            continue
        choices = st.sampled_from([str(c) for c in action.choices or []] or PLAIN)
        hostile = [st.sampled_from(NUMBERS), st.sampled_from(paths), st.sampled_from(TEXT)]
        # Half the values are plain, so that most examples get past argparse and the
        # hostile ones meet the command itself.
        value = draw(st.one_of(choices, choices, choices, *hostile, st.text(max_size=8)))
        argv.append(f"{flag}={value}" if draw(st.booleans()) else flag)
        if not argv[-1].startswith(f"{flag}="):
            argv.append(value)
    return argv


@pytest.fixture(autouse=True)
def offline(monkeypatch) -> None:
    go_offline(monkeypatch)


@settings(
    FUZZ,
    max_examples=int(os.environ.get("DFLASH_FUZZ_EXAMPLES", "300")),  # more: a hostile round
    suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_flags_of_any_command_end_cleanly(data, pool, capsys):
    root, paths = pool
    argv = data.draw(invocations(paths, root))
    run_command(argv, capsys, COUNTS, FAILURES, WALL_SECONDS)
