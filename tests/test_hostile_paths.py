"""Hostile paths and a hostile environment for every command that writes (issue 32).

What each test holds, found by trying them as a careless or hostile user would:

- an output that is one of the command's inputs (the sources YAML given as `prompts --out`,
  the drafter's meta.json as `eval --json`), or that lies inside an input directory read
  whole, is refused and the input is left byte for byte;
- an append output (`regenerate`, `synthesize`) naming a file that is not ours is refused,
  never cut: a file without a final newline is not a record interrupted mid-write;
- an output path that names no file (`.`, a directory, a `--png` that is not .png), or runs
  through a file, is a one-line error naming it, never a traceback;
- a name of 240 bytes (valid) is written; a name of 300 bytes is an error naming the path;
- a directory whose name is not UTF-8 is exported, checked, imported and evaluated;
- LC_ALL=C without UTF-8 mode, HOME unset, TMPDIR missing, COLUMNS=0 and stdin closed change
  nothing; a reader of stdout that went away (`| head -c1`) does not stop the command;
- a FIFO or a device given as an evaluation report is refused at once, not read forever.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from fuzz_support import go_offline, time_limit
from hostile_support import World, build_world, dflash, eval_args, report_ok, tree

from dflash_trainer.cli import COMMANDS, _build_parser, main
from dflash_trainer.cli_errors import INTERNAL_ERROR, USER_ERROR
from dflash_trainer.cli_paths import path, path_obj, text

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("world"))


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    go_offline(monkeypatch)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with time_limit(60, "command"):
        rc = main(argv)
    err = capsys.readouterr().err
    assert rc != INTERNAL_ERROR and "Traceback" not in err, err
    return rc, " ".join(err.split())


def _regenerate(w: World, out: Path, inp: Path | None = None) -> list[str]:
    return ["data", "regenerate", "--input", str(inp or w.conversations), "--model",
            str(w.target), "--out", str(out), "--device", "cpu", "--max-new-tokens", "2",
            "--no-progress", "--max-records", "1"]  # fmt: skip


def _synthesize(w: World, out: Path) -> list[str]:
    return ["data", "synthesize", "--model", str(w.target), "--out", str(out), "--n", "1",
            "--device", "cpu", "--max-new-tokens", "2", "--no-progress"]  # fmt: skip


@pytest.mark.parametrize("command", ["regenerate", "synthesize"])
def test_an_append_output_that_is_not_ours_is_refused_not_cut(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    victim = tmp_path / "notes.txt"
    victim.write_text("my notes, without a newline at the end")
    link = tmp_path / "out.jsonl"
    link.symlink_to(victim)
    build = _regenerate if command == "regenerate" else _synthesize
    for out in (victim, link):
        rc, err = _run(build(world, out), capsys)
        assert rc == USER_ERROR and "not a record this tool writes" in err, err
        assert victim.read_text() == "my notes, without a newline at the end"


def _copy(src: Path, dest: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dest)
    else:
        shutil.copy(src, dest)
    return dest


CASES = {
    # name: (what to copy into the test directory, argv given that copy, what the error says)
    "prompts --out is the sources YAML": (
        "sources",
        lambda w, c: [
            "data",
            "prompts",
            "--sources",
            str(c),
            "--out",
            str(c),
            "--decontam-evals",
            "none",
        ],
        "is the input",
    ),
    "regenerate --out is the input": (
        "conversations",
        lambda w, c: _regenerate(w, c, c),
        "is the input",
    ),
    "eval --json is the drafter's meta.json": (
        "run",
        lambda w, c: [*eval_args(w), "--json", str(c / "drafter" / "meta.json")],
        "is not a report written by this tool",
    ),
    "export OUT is the source": (
        "run",
        lambda w, c: ["export", str(c), "--to", "zlab", str(c), "--force"],
        "is the input",
    ),
    "import --out is the export": (
        "export",
        lambda w, c: ["import", str(c), "--out", str(c)],
        "is the input",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    field, argv, says = CASES[case]
    copy = _copy(getattr(world, field), tmp_path / f"copy-{field}")
    before = tree(copy)
    rc, err = _run(argv(world, copy), capsys)
    assert rc == USER_ERROR and says in err, err
    assert tree(copy) == before


@pytest.mark.parametrize("command", ["prepare", "regenerate"])
def test_an_output_inside_the_input_directory_is_refused(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(world.conversations, data / "a.jsonl")
    if command == "prepare":
        argv = ["data", "prepare", "--input", str(data), "--tokenizer", str(world.target),
                "--out", str(data / "prepared")]  # fmt: skip
    else:
        argv = _regenerate(world, data / "answers.jsonl", data)
    rc, err = _run(argv, capsys)
    assert rc == USER_ERROR and "lies inside the input directory" in err, err
    assert sorted(p.name for p in data.iterdir()) == ["a.jsonl"]


def test_output_paths_that_name_no_file_are_one_line_errors(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("x")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    cases = [
        (_synthesize(world, Path(".")), "is a directory"),
        (
            ["data", "synthesize", "--model", str(world.target), "--out", "", "--n", "1"],
            "is a directory",  # argparse makes an empty --out the current directory
        ),
        ([*eval_args(world), "--json", "."], "is a directory"),
        ([*eval_args(world), "--json", str(afile / "r.json")], "is a file, not a directory"),
        ([*eval_args(world), "--out-dir", str(dangling)], "link to nothing"),
        (["data", "stats", str(tmp_path), "--png", str(tmp_path / "h.jpg")], "name a .png file"),
        (_regenerate(world, afile / "out.jsonl"), "is a file, not a directory"),
        (["plot", str(world.run), "--out", str(afile)], "a file where a directory is needed"),
        (["plot", str(world.run), "--out", str(dangling)], "a link to nothing"),
    ]
    for argv, says in cases:
        rc, err = _run(argv, capsys)
        assert rc == USER_ERROR and says in err, (argv, err)
    assert afile.read_text() == "x"


def test_long_names_are_written_or_named_in_the_error(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ok = "n" * 240
    rc, _ = _run(["export", str(world.run), "--to", "zlab", str(tmp_path / ok)], capsys)
    assert rc == 0 and (tmp_path / ok / "model.safetensors").is_file()
    rc, _ = _run([*eval_args(world), "--json", str(tmp_path / f"{ok[:-5]}.json")], capsys)
    assert rc == 0 and report_ok(tmp_path / f"{ok[:-5]}.json")
    too_long = tmp_path / ("n" * 300)
    for argv in (
        ["export", str(world.run), "--to", "zlab", str(too_long)],
        [*eval_args(world), "--json", str(too_long)],
        ["import", str(world.export), "--out", str(too_long)],
    ):
        rc, err = _run(argv, capsys)
        assert rc == USER_ERROR and "too long" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ok, f"{ok[:-5]}.json"])


def test_a_directory_named_in_bytes_that_are_not_utf8_round_trips(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exported = os.fsdecode(os.fsencode(tmp_path) + b"/exp\xff")
    imported = os.fsdecode(os.fsencode(tmp_path) + b"/imp\xfe")
    assert _run(["export", str(world.run), "--to", "zlab", exported], capsys)[0] == 0
    assert _run(["export", "--check", exported], capsys)[0] == 0
    assert _run(["import", exported, "--out", imported], capsys)[0] == 0
    argv = eval_args(world)
    argv[argv.index("--drafter") + 1] = imported
    assert _run(argv, capsys)[0] == 0


def test_a_fifo_or_a_device_as_a_report_is_refused_at_once(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "eval.json"
    os.mkfifo(fifo)
    for report in (fifo, Path("/dev/zero")):
        rc, err = _run(["lineage", "add-eval", str(world.drafter), str(report)], capsys)
        assert rc == USER_ERROR and "not a regular file" in err, err


def test_inputs_that_are_not_files_are_named_for_what_they_are(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    answered = tmp_path / "answered.jsonl"
    shutil.copy(world.conversations, answered)  # every user turn has its answer
    with_prompts = eval_args(world)
    at = with_prompts.index("--prompts") + 1
    cases = [
        ([*with_prompts[:at], str(fifo), *with_prompts[at + 1 :]], "is a FIFO"),
        ([*with_prompts[:at], str(empty), *with_prompts[at + 1 :]], "holds no prompts"),
        ([*with_prompts[:at], str(answered), *with_prompts[at + 1 :]], "no user turn left"),
        (["data", "prompts", "--sources", str(tmp_path), "--out", str(tmp_path / "p.jsonl")],
         "is a directory"),
        (["data", "prompts", "--sources", str(world.sources), "--out", str(tmp_path / "p.jsonl"),
          "--decontam-evals", "none", "--decontam-file", str(fifo)], "is a FIFO"),
    ]  # fmt: skip
    for argv, says in cases:
        rc, err = _run(argv, capsys)
        assert rc == USER_ERROR and says in err, (argv, err)


def test_a_hostile_environment_changes_nothing(world: World, tmp_path: Path) -> None:
    """Not UTF-8 (LC_ALL=C, PYTHONUTF8=0), no HOME, a TMPDIR that does not exist, a terminal
    0 columns wide, stdin closed: an export into a non-ASCII directory still works."""
    out = tmp_path / "exporté"
    env = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": None,
           "HOME": None, "TMPDIR": str(tmp_path / "missing"), "COLUMNS": "0"}  # fmt: skip
    done = dflash(["export", str(world.run), "--to", "zlab", str(out)], env, stdin=None)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    check = dflash(["export", "--check", str(out)], env)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_reader_that_went_away_does_not_stop_the_command(world: World, tmp_path: Path) -> None:
    """`dflash import ... | head -c1`: stdout fails with EPIPE; the import is written whole."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command prints anything
    try:
        done = dflash(["import", str(world.export), "--out", str(tmp_path / "d")], stdout=write,
                      capture_output=False, stderr=subprocess.PIPE)  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 0 and "Broken pipe" not in done.stderr, done.stderr
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "drafter.safetensors", "meta.json", "spec.json"]  # fmt: skip


STRING_TYPES = (None, str, Path, path, path_obj, text)


def _string_flags() -> dict[str, argparse.Action]:
    """Every flag and positional of every command in the registry that takes a string (not a
    number, not a choice), by `COMMAND [SUBCOMMAND] FLAG`."""
    found: dict[str, argparse.Action] = {}

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*words, name])
            elif action.nargs != 0 and not action.choices and action.type in STRING_TYPES:
                name = action.option_strings[-1] if action.option_strings else action.dest
                found[" ".join([*words, name])] = action

    for command in COMMANDS:
        for action in _build_parser(command)._actions:
            if isinstance(action, argparse._SubParsersAction):
                walk(action.choices[command], [command])
    return found


STRING_FLAGS = _string_flags()


@pytest.mark.parametrize("flag", sorted(STRING_FLAGS))
def test_every_path_flag_expands_home_alike(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--out=~/x` (no shell expands it) means the same as `--out ~/x`, for every flag that
    takes a path; free text (`type=text`) is kept as written."""
    monkeypatch.setenv("HOME", str(tmp_path))
    action = STRING_FLAGS[flag]
    assert action.type is not None, f"{flag}: argparse would keep a literal ~"
    got = action.type("~/x")
    if action.type is text:
        assert got == "~/x"
    else:
        assert os.fspath(got) == str(tmp_path / "x"), flag


def test_home_in_input_and_output_flags_reaches_the_command(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """`data prepare --input=~/... --tokenizer=~/... --out=~/...`: what no shell expanded is
    read and written under HOME, and no directory named `~` appears."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(world.conversations, home / "in.jsonl")
    shutil.copytree(world.target, home / "target")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    rc, err = _run(["data", "prepare", "--input=~/in.jsonl", "--tokenizer=~/target",
                    "--out=~/prep", "--eval-fraction", "0"], capsys)  # fmt: skip
    assert rc == 0, err
    assert (home / "prep" / "manifest.json").is_file()
    assert not (tmp_path / "~").exists()
