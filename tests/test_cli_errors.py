"""The one error boundary of `dflash`: user errors are one paragraph and exit 2, a bug says it
is one (traceback behind --debug / DFLASH_DEBUG=1), Ctrl-C is a short line and exit 130."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from dflash_trainer import cli
from dflash_trainer.cli_errors import INTERNAL_ERROR, INTERRUPTED, USER_ERROR, report
from dflash_trainer.errors import about

RUN = Path(__file__).parent / "fixtures" / "run-before-layout" / "run"


def _raise_from(fn):
    try:
        fn()
    except BaseException as e:
        return e
    raise AssertionError("did not raise")


def test_disk_full_names_the_file_and_the_fix(capsys):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")

    def write():
        with open("/dev/full", "w") as f:
            f.write("x" * 10)
            f.flush()

    e = _raise_from(write)
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert report("eval", e, debug=False) == USER_ERROR
    err = capsys.readouterr().err
    assert "disk is full" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plot", "x" * 300], "too long"),
        (["plot", str(RUN), "--out", "/etc/passwd/plots"], "not a directory"),
    ],
)
def test_os_errors_of_a_command_are_one_paragraph(argv, needle, capsys):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == USER_ERROR, err
    assert needle in err.lower() and "Traceback" not in err


def test_a_library_error_names_what_was_read(capsys):
    def parse():
        import yaml

        with about("the config 'c.yaml'"):
            yaml.safe_load("a: [1,")

    e = _raise_from(parse)
    assert report("plan", e, debug=False) == USER_ERROR
    err = capsys.readouterr().err
    assert "yaml refused the input (while reading the config 'c.yaml')" in err


def test_a_bug_says_so_and_shows_its_traceback_only_with_debug(capsys, monkeypatch):
    e = _raise_from(lambda: [][1])  # an IndexError in our own code: a bug
    assert report("plan", e, debug=False) == INTERNAL_ERROR
    err = capsys.readouterr().err
    assert "internal error: IndexError" in err and "--debug" in err and "Traceback" not in err
    assert report("plan", e, debug=True) == INTERNAL_ERROR
    assert "Traceback" in capsys.readouterr().err

    from dflash_trainer.plan import report as plan_report

    def broken(args):
        return [][1]

    monkeypatch.setattr(plan_report, "run_plan", broken)
    for argv, env in ((["plan", "--recipe", "qwen3-8b"], "1"), (["plan", "--debug"], "")):
        monkeypatch.setenv("DFLASH_DEBUG", env)
        assert cli.main(argv) == INTERNAL_ERROR
        assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("DFLASH_DEBUG", "0")
    assert cli.main(["--debug", "plan"]) == INTERNAL_ERROR
    assert "Traceback" in capsys.readouterr().err


def test_ctrl_c_is_a_short_line_and_130(capsys, monkeypatch):
    from dflash_trainer.plan import report as plan_report

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_report, "run_plan", interrupted)
    assert cli.main(["plan"]) == INTERRUPTED
    err = capsys.readouterr().err
    assert err.strip() == "dflash plan: interrupted"


def test_read_only_directory_is_a_user_error(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        rc = cli.main(["plot", str(tmp_path), "--out", str(ro / "plots")])
    finally:
        ro.chmod(0o700)
    err = capsys.readouterr().err
    assert rc == USER_ERROR and "Traceback" not in err
