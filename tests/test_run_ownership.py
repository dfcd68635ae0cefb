"""The trainer deletes only what it wrote (real tiny runs and real checkpoints on CPU).

- the checkpoint directory's sweep removes this tool's marked temporaries of dead saves and
  nothing else: another program's `.tmp-*` stays;
- a step_* symbolic link (to another run's checkpoint) is never loaded, pruned or deleted
  through, not even by --overwrite;
- `dflash train --dry-run` changes nothing outside its own scratch directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_spec
from test_atomic_dir import _dead_pid, _leftover
from test_checkpoint import _save
from trainer_utils import tiny_config

from dflash_trainer.cli import main
from dflash_trainer.config import config_to_dict
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.errors import DFlashError
from dflash_trainer.train.checkpoint import Checkpointer, remove_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every path under `root` (links not followed) with its bytes, or its link target."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = p.read_bytes()
            else:
                out[rel] = "dir"
    return out


def test_the_checkpoint_sweep_keeps_other_programs_temporaries(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    theirs = [root / ".tmp-x", root / ".tmp-step_00000001", root / ".LATEST.tmp-y"]
    for p in theirs:
        p.mkdir()
        (p / "data").write_text("not dflash's")
    (root / ".tmp-file").write_text("a file")
    dead = _leftover(root, "step_00000007", _dead_pid())
    said: list[str] = []
    ck = Checkpointer(str(root), keep_last=1, log=said.append)
    assert not dead.exists() and any(f"removed {dead}" in s for s in said), said
    torch.manual_seed(0)
    model = DFlashDrafter(make_spec())
    for step in (1, 2):
        _save(ck, step, model)
    for p in theirs:
        assert (p / "data").read_text() == "not dflash's"
    assert (root / ".tmp-file").read_text() == "a file"
    assert ck.list() == ["step_00000002"]
    # A checkpoint never holds the temporary's marker (its checksums cover what it holds).
    assert ".dflash-temp.json" not in os.listdir(root / "step_00000002")
    assert ck.load().trainer_state["step"] == 2


def test_a_linked_checkpoint_is_never_loaded_pruned_or_deleted_through(tmp_path):
    torch.manual_seed(0)
    model = DFlashDrafter(make_spec())
    other = tmp_path / "other-run"
    _save(Checkpointer(str(other)), 9, model)  # a complete checkpoint of another run
    before = _tree(other)
    root = tmp_path / "ck"
    root.mkdir()
    (root / "step_00000009").symlink_to(other / "step_00000009")
    (root / "LATEST").write_text("step_00000009\n")
    said: list[str] = []
    ck = Checkpointer(str(root), keep_last=1, log=said.append)
    with pytest.raises(DFlashError, match="no complete checkpoint"):
        ck.load()  # the link is the only step_*: not this run's
    assert any("step_00000009 is a symbolic link" in s for s in said), said
    for step in (1, 2, 3):  # pruning down to one checkpoint
        _save(ck, step, model)
    assert ck.list() == ["step_00000003"] and ck.load().name == "step_00000003"
    assert (root / "step_00000009").is_symlink()
    remove_checkpoints(str(root), log=said.append)  # --overwrite's start-over
    assert sorted(os.listdir(root)) == ["step_00000009"]
    assert _tree(other) == before


def test_a_dry_run_deletes_nothing(tmp_path, capsys):
    ck = tmp_path / "ck"
    cfg = tiny_config(
        tmp_path,
        run={"checkpoint_dir": str(ck)},
        training={"max_steps": 2, "checkpoint_every": 1},
    )
    from dflash_trainer.train.trainer import Trainer

    Trainer(cfg, log_to_console=False).train()
    dead = _leftover(ck, "step_00000005", _dead_pid())
    (ck / ".tmp-x").mkdir()
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    run = Path(cfg.run.output_dir)
    before_ck, before_run = _tree(ck), _tree(run)
    for extra in ([], ["--overwrite"]):
        argv = ["train", "--config", str(path), "--dry-run", "--skip-doctor", *extra]
        assert main(argv) == 0, capsys.readouterr()
        assert "dry run OK" in capsys.readouterr().out
        assert _tree(ck) == before_ck and dead.is_dir()
        after = {k: v for k, v in _tree(run).items() if not k.startswith("dry-run")}
        assert after == before_run
