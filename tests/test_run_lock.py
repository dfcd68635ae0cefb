"""One writer per run directory and per prepared directory (real processes).

- a second `dflash train` on a run directory in use is refused, naming the holder's pid and
  host, and so is a second `prepare` of the same output;
- a lock left by a process killed with kill -9 is taken over, and that is said;
- a lock file naming another host, a live process, or a link is refused; a reused process
  id or an unreadable file is taken over.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from test_atomic_dir import KILLED_PREPARE, TESTS, _dead_pid
from test_data_support import sharegpt, tiny_tokenizer, write_jsonl
from trainer_utils import tiny_config

from dflash_trainer.config import config_to_dict
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.shards import PreparedDataset
from dflash_trainer.dir_lock import RUN_LOCK, _proc_start, acquire, output_lock_path
from dflash_trainer.errors import DFlashError
from dflash_trainer.train.run_dir import read_metrics

HOST = socket.gethostname()

HOLDER = textwrap.dedent(
    """
    import sys, time
    from dflash_trainer.dir_lock import acquire
    acquire(sys.argv[1], "holder", "the test directory")
    print("locked", flush=True)
    time.sleep(120)
    """
)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def test_a_held_lock_is_refused_and_a_dead_holders_is_taken_over(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        with pytest.raises(DFlashError) as e:
            acquire(tmp_path, "second", "the test directory")
        assert f"process {proc.pid} on host {HOST}" in str(e.value)
        assert "`holder`" in str(e.value) and "in use" in str(e.value)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        _stop(proc)
    said: list[str] = []
    lock = acquire(tmp_path, "second", "the test directory", log=said.append)
    assert len(said) == 1 and f"process {proc.pid}" in said[0] and "took over" in said[0]
    again = acquire(tmp_path, "second", "the test directory")  # re-entrant in one process
    again.release()
    assert (tmp_path / RUN_LOCK).exists()
    lock.release()
    assert not (tmp_path / RUN_LOCK).exists()  # released: nothing left behind


def _holder(**fields) -> str:
    base = {"pid": _dead_pid(), "host": HOST, "started": "then", "command": "dflash train"}
    return json.dumps(base | fields)


def test_what_a_lock_file_says_decides_when_its_flock_is_free(tmp_path):
    path = tmp_path / RUN_LOCK
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)  # /proc/<pid>/stat is there from the fork on
        start = _proc_start(sleeper.pid)
        refused = {
            "another host": (_holder(host="elsewhere-node"), "cannot check", str(path)),
            "a live process": (_holder(pid=sleeper.pid, proc_start=start), "in use", "then"),
        }
        for case, (text, *words) in refused.items():
            path.write_text(text)
            with pytest.raises(DFlashError) as e:
                acquire(tmp_path, "x", "the run")
            assert all(w in str(e.value) for w in words), (case, e.value)
            assert path.read_text() == text  # left as it was
        taken = {
            "a reused process id": _holder(pid=sleeper.pid, proc_start="1"),
            "unreadable": "\0garbage{",
        }
        for case, text in taken.items():
            path.write_text(text)
            said: list[str] = []
            acquire(tmp_path, "x", "the run", log=said.append).release()
            assert len(said) == 1 and "took over" in said[0], case
    finally:
        _stop(sleeper)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("precious")
    path.symlink_to(elsewhere)
    with pytest.raises(DFlashError, match="symbolic link"):
        acquire(tmp_path, "x", "the run")
    assert elsewhere.read_text() == "precious"


def test_two_trainers_on_one_run_directory(tmp_path, capsys):
    cfg = tiny_config(
        tmp_path, training={"max_steps": 100000, "checkpoint_every": 1, "log_every": 1}
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    train = [sys.executable, "-m", "dflash_trainer.cli", "train", "--skip-doctor"]
    first = subprocess.Popen(
        [*train, "--config", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    run = Path(cfg.run.output_dir)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(read_metrics(run)) < 2:
            time.sleep(0.2)
        assert len(read_metrics(run)) >= 2, "the first trainer never logged a step"
        for second in (["--config", str(path)], ["--resume", str(run)]):
            out = subprocess.run([*train, *second], capture_output=True, text=True, timeout=120)
            assert out.returncode == 2, out.stdout + out.stderr
            assert f"process {first.pid} on host {HOST}" in out.stderr, out.stderr
            assert "`dflash train`" in out.stderr
        assert first.poll() is None  # the first one trains on, untouched
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        _stop(first)
    from dflash_trainer.train.trainer import Trainer

    capsys.readouterr()
    tr = Trainer(cfg, resume=True, log_to_console=False)
    assert tr.step >= 1
    err = capsys.readouterr().err
    assert f"took over the lock of run directory {run}" in err and str(first.pid) in err, err
    tr.release()


def test_two_prepares_of_one_output(tmp_path, capfd):
    rows = [sharegpt(("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(20)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "prep"
    script = tmp_path / "prepare.py"
    script.write_text(KILLED_PREPARE.format(tests=str(TESTS), src=str(src), out=str(out)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        with pytest.raises(DFlashError) as e:
            prepare_dataset(src, tiny_tokenizer(), out)
        assert f"process {proc.pid} on host {HOST}" in str(e.value)
        assert "`dflash data prepare`" in str(e.value)
        assert len(list(tmp_path.glob(".prep.tmp-*"))) == 1  # the first one's, untouched
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        _stop(proc)
    capfd.readouterr()
    prepare_dataset(src, tiny_tokenizer(), out)
    err = capfd.readouterr().err
    assert "took over the lock" in err and f"process {proc.pid}" in err, err
    assert len(PreparedDataset(out)) + len(PreparedDataset(out, "eval")) == 20
    assert not output_lock_path(out).exists()
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "prep", "prepare.py"]
