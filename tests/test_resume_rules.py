"""A resume continues the run exactly, or says why not (real tiny runs on CPU).

- a config that changes what the run trains is refused with every difference (old -> new),
  from the command line or from an edited config.yaml; --allow-config-change continues,
  warning, and records the changes in run_info.json; harmless fields resume silently;
- other data at the same path, or a drafter of another geometry, is refused;
- damaged side files (metrics rows, run_info.json, LATEST, checksums, trainer state) are
  repaired with a message or make the resume fall back, never a traceback.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
import yaml
from trainer_utils import copy_run, train_finished_run, write_prepared

from dflash_trainer.cli import main
from dflash_trainer.config import Config
from dflash_trainer.errors import DFlashError
from dflash_trainer.train.run_dir import read_metrics
from dflash_trainer.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Config]:
    """A 4-step run, checkpoints at steps 2 and 4 (copied by each test that changes it)."""
    tmp = tmp_path_factory.mktemp("finished")
    return tmp, train_finished_run(tmp)


def _resume(run: Path, capsys, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["train", "--resume", str(run), *extra])
    out = capsys.readouterr()
    return rc, out.out + out.err


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if "loss" in r]


def test_a_changed_run_is_refused_with_every_difference(finished, tmp_path, capsys):
    cfg = copy_run(finished, tmp_path)
    run = Path(cfg.run.output_dir)
    before = {n: (run / n).read_bytes() for n in ("metrics.jsonl", "run_info.json", "config.yaml")}
    changes = {
        "training.seed=7": "training.seed: 0 -> 7",
        "data.token_budget=512": "data.token_budget: 256 -> 512",
        "training.grad_accum_steps=2": "training.grad_accum_steps: 1 -> 2",
        "training.loss=kl": 'training.loss: "ce" -> "kl"',
        "drafter.block_size=6": "drafter.block_size: 4 -> 6",
        "drafter.target_layer_ids=[0,2]": "drafter.target_layer_ids: null -> [0, 2]",
    }
    rc, out = _resume(run, capsys, *changes)
    assert rc == 2, out
    for shown in changes.values():
        assert shown in out, (shown, out)
    assert "--allow-config-change" in out and "Traceback" not in out
    for name, data in before.items():  # refused before anything was written
        assert (run / name).read_bytes() == data, name
    # The same fields as the run's, and the harmless ones: resumed silently.
    harmless = ["training.log_every=2", "training.eval_every=0", "training.keep_last=5"]
    rc, out = _resume(run, capsys, "training.seed=0", *harmless)
    assert rc == 0 and "resume with" not in out and "allow-config-change" not in out, out


def test_allow_config_change_continues_warns_and_records(finished, tmp_path, capsys):
    cfg = copy_run(finished, tmp_path)
    run = Path(cfg.run.output_dir)
    rc, out = _resume(
        run, capsys, "--allow-config-change", "training.seed=3", "training.max_steps=6"
    )
    assert rc == 0, out
    assert "--allow-config-change: training.seed: 0 -> 3" in out
    assert "resume with training.max_steps: 4 -> 6: the learning-rate schedule" in out
    info = json.loads((run / "run_info.json").read_text())
    assert {"field": "training.seed", "old": 0, "new": 3} in info["config_changes"]
    assert len(info["history"]) == 1  # the first start, kept
    assert _steps(run) == [1, 2, 3, 4, 5, 6]


def test_an_edited_config_yaml_is_caught_by_the_checkpoints_record(finished, tmp_path, capsys):
    cfg = copy_run(finished, tmp_path)
    run = Path(cfg.run.output_dir)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["training"]["lr"] = 0.1
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    rc, out = _resume(run, capsys)
    assert rc == 2 and "step_00000004" in out and "training.lr: 0.003 -> 0.1" in out, out


def test_other_data_at_the_same_path_is_refused(finished, tmp_path, capsys):
    cfg = copy_run(finished, tmp_path)
    run = Path(cfg.run.output_dir)
    data = tmp_path / "data"
    write_prepared(data, n_docs=30, seed=5)
    rc, out = _resume(run, capsys, f"data.train={data}")
    assert rc == 2 and "data (prepared train)" in out and '"documents": 40' in out, out


def test_another_drafter_geometry_cannot_continue_even_when_allowed(finished, tmp_path, capsys):
    cfg = copy_run(finished, tmp_path)
    run = Path(cfg.run.output_dir)
    rc, out = _resume(run, capsys, "drafter.intermediate_size=96")
    assert rc == 2 and "drafter.intermediate_size: null -> 96" in out, out
    rc, out = _resume(run, capsys, "--allow-config-change", "drafter.intermediate_size=96")
    assert rc == 2 and "another geometry (intermediate_size: 64 -> 96)" in out, out
    assert "even with --allow-config-change" in out and "Traceback" not in out


def test_damaged_metrics_and_run_info_are_repaired_and_said(finished, tmp_path, capsys):
    cfg = copy_run(finished, tmp_path)
    run = Path(cfg.run.output_dir)
    rows = (run / "metrics.jsonl").read_bytes()
    bad = b'[1, 2]\n{"step": "x", "loss": 1}\n\xff\xfe garbage\n{"step": NaN}\n'
    (run / "metrics.jsonl").write_bytes(bad + rows + b'{"step": 9, "lo')
    assert _steps(run) == [1, 2, 3, 4]  # readers skip what does not parse
    (run / "run_info.json").write_bytes(b"\x00{not json")
    rc, out = _resume(run, capsys, "training.max_steps=5")
    assert rc == 0, out
    assert "dropped 5 damaged row(s)" in out, out
    assert "run_info.json was damaged" in out and "history starts over" in out
    assert _steps(run) == [1, 2, 3, 4, 5]
    kept = list(run.glob("run_info.json.damaged-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == b"\x00{not json"
    assert json.loads((run / "run_info.json").read_text())["history"] == []


@pytest.mark.parametrize("latest", [b"\xff\xfe\x00", b"step_00000004" * 10000, "dir"])
def test_a_damaged_latest_is_ignored_or_refused_with_a_message(finished, tmp_path, capsys, latest):
    cfg = copy_run(finished, tmp_path)
    run = Path(cfg.run.output_dir)
    pointer = run / "checkpoints" / "LATEST"
    pointer.unlink()
    if latest == "dir":
        pointer.mkdir()
        rc, out = _resume(run, capsys)
        assert rc == 2 and "LATEST is not a file" in out and "Traceback" not in out, out
        return
    pointer.write_bytes(latest)
    tr = Trainer(cfg, resume=True, log_to_console=False)
    assert tr.step == 4  # the newest complete step_* directory
    assert "ignoring it" in capsys.readouterr().err


def test_missing_checksums_warn_that_the_weights_are_unverified(finished, tmp_path, capsys):
    cfg = copy_run(finished, tmp_path)
    ck = Path(cfg.run.output_dir) / "checkpoints"
    (ck / "step_00000004" / "checksums.json").unlink()
    capsys.readouterr()
    assert Trainer(cfg, resume=True, log_to_console=False).step == 4
    err = capsys.readouterr().err
    assert "step_00000004 has no checksums.json" in err and "unverified" in err, err


def test_nan_weights_in_a_checkpoint_are_named_before_any_step(finished, tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = copy_run(finished, tmp_path)
    step = Path(cfg.run.output_dir) / "checkpoints" / "step_00000004"
    state = load_file(str(step / "drafter.safetensors"))
    key = sorted(state)[0]
    state[key] = state[key].clone().fill_(float("inf"))
    save_file(state, str(step / "drafter.safetensors"))
    (step / "checksums.json").unlink()  # an edit by hand, with no checksums left to catch it
    with pytest.raises(DFlashError, match=f"step_00000004: tensor '{key}' holds NaN or inf"):
        Trainer(cfg, resume=True, log_to_console=False)


@pytest.mark.parametrize(
    ("name", "content", "why"),
    [
        ("checksums.json", {"sha256": {"../../metrics.jsonl": "0"}}, "not a map of"),
        ("checksums.json", {"sha256": ["a"]}, "not a map of"),
        ("trainer_state.json", {"step": 4}, "position is None"),
        ("trainer_state.json", [1], "not a JSON object"),
    ],
)
def test_damaged_checkpoint_records_fall_back_to_an_intact_one(
    finished, tmp_path, capsys, name, content, why
):
    cfg = copy_run(finished, tmp_path)
    step = Path(cfg.run.output_dir) / "checkpoints" / "step_00000004"
    if name != "checksums.json":  # a record edited by hand, with no checksums to catch it
        (step / "checksums.json").unlink()
    (step / name).write_text(json.dumps(content))
    capsys.readouterr()
    assert Trainer(cfg, resume=True, log_to_console=False).step == 2
    err = capsys.readouterr().err
    assert "step_00000004 is damaged" in err and why in err, err


def test_a_trainer_state_without_the_trainer_s_counters_is_refused_by_name(finished, tmp_path):
    cfg = copy_run(finished, tmp_path)
    step = Path(cfg.run.output_dir) / "checkpoints" / "step_00000004"
    (step / "checksums.json").unlink()
    (step / "trainer_state.json").write_text('{"step": 4, "position": {"epoch": 0, "step": 4}}')
    with pytest.raises(DFlashError, match=r"step_00000004/trainer_state.json lacks scheduler"):
        Trainer(cfg, resume=True, log_to_console=False)


def test_an_edited_config_is_refused_before_the_target_loads(finished, tmp_path, capsys):
    """config.yaml against the checkpoint's record comes before any weights load: with the
    target moved away (the same name elsewhere), the refusal is the changed seed, not a
    missing target."""
    cfg = copy_run(finished, tmp_path)
    run = Path(cfg.run.output_dir)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["training"]["seed"] = 7
    saved["target"]["name_or_path"] = str(tmp_path / "elsewhere" / "target")
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    rc, out = _resume(run, capsys)
    assert rc == 2 and "step_00000004" in out and "training.seed: 0 -> 7" in out, out
    assert "loading target" not in out


@pytest.mark.parametrize("name", ["checksums.json", "trainer_state.json", "meta.json"])
def test_a_fifo_among_the_checkpoint_files_is_damage_not_a_hang(finished, tmp_path, capsys, name):
    cfg = copy_run(finished, tmp_path)
    step = Path(cfg.run.output_dir) / "checkpoints" / "step_00000004"
    if name != "checksums.json":  # without checksums, the reader itself meets the FIFO
        (step / "checksums.json").unlink()
    (step / name).unlink()
    os.mkfifo(step / name)
    capsys.readouterr()
    t0 = time.perf_counter()
    assert Trainer(cfg, resume=True, log_to_console=False).step == 2
    assert time.perf_counter() - t0 < 30
    err = capsys.readouterr().err
    assert "step_00000004 is damaged" in err and "FIFO" in err, err


def test_a_fifo_run_info_is_kept_aside_not_waited_on(finished, tmp_path, capsys):
    cfg = copy_run(finished, tmp_path)
    run = Path(cfg.run.output_dir)
    (run / "run_info.json").unlink()
    os.mkfifo(run / "run_info.json")
    rc, out = _resume(run, capsys)
    assert rc == 0 and "run_info.json was damaged" in out and "FIFO" in out, out
    (kept,) = run.glob("run_info.json.damaged-*")
    assert stat.S_ISFIFO(os.lstat(kept).st_mode)
