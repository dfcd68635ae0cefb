"""A run directory written before the package was split into subpackages still resumes.

tests/fixtures/run-before-layout holds a tiny target, its prepared data and the step-4
checkpoint of an 8-step run, all written by the code of the flat layout, plus the losses of the
same run uninterrupted. Resuming it with today's code must reproduce those losses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_trainer.config import load_config
from dflash_trainer.train.run_dir import read_metrics
from dflash_trainer.train.trainer import Trainer

FIXTURE = Path(__file__).parent / "fixtures" / "run-before-layout"
WRITTEN_AT = "/tmp/fx/out"  # the directory the fixture was written in


def test_old_run_directory_resumes_to_the_same_losses(tmp_path):
    root = tmp_path / "old"
    shutil.copytree(FIXTURE, root)
    cfg_file = root / "run" / "config.yaml"
    cfg_file.write_text(cfg_file.read_text().replace(WRITTEN_AT, str(root)))
    cfg = load_config(config_file=str(cfg_file))
    trainer = Trainer(cfg, resume=True, log_to_console=False)
    assert trainer.step == 4
    trainer.train()
    expected = json.loads((root / "expected_losses.json").read_text())
    got = [[r["step"], r["loss"]] for r in read_metrics(root / "run")]
    by_step = dict((s, loss) for s, loss in got)
    for step, loss in expected:
        assert by_step[step] == pytest.approx(loss, rel=1e-6), step
