"""A run directory survives what users and disks do to it (real tiny runs on CPU).

- a fresh `train` into a directory with checkpoints is refused, or starts over when asked;
- metrics.jsonl keeps one row per step across resumes, even after a torn last line;
- a damaged file in the latest checkpoint: resume falls back to the newest intact one,
  saying which file; with none intact it refuses, naming the files;
- LATEST naming a path outside the checkpoint directory is not followed;
- a step whose anchors supervise nothing is skipped without using up the schedule.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from trainer_utils import VOCAB, copy_run, tiny_config, train_finished_run

from dflash_trainer.config import Config, replace
from dflash_trainer.data.shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST, ShardWriter
from dflash_trainer.errors import DFlashError
from dflash_trainer.train.checkpoint import Checkpointer
from dflash_trainer.train.run_dir import read_metrics
from dflash_trainer.train.trainer import Trainer

CHECKPOINT_FILES = [
    "drafter.safetensors",
    "optimizer.safetensors",
    "optimizer.json",
    "trainer_state.json",
    "trainer_state.safetensors",
    "spec.json",
]


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if "loss" in r]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, Config]:
    """A 4-step run with checkpoints at steps 2 and 4 (copied by each test that damages it)."""
    tmp = tmp_path_factory.mktemp("finished")
    return tmp, train_finished_run(tmp)


def test_fresh_train_over_checkpoints_is_refused_unless_overwrite(finished_run, tmp_path):
    cfg = copy_run(finished_run, tmp_path)
    run = Path(cfg.run.output_dir)
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(DFlashError, match=r"--resume .*new run\.output_dir.*--overwrite"):
        Trainer(cfg, log_to_console=False)
    assert Checkpointer(str(run / "checkpoints")).latest() == "step_00000004"
    assert (run / "metrics.jsonl").read_text() == before
    # Asked explicitly: the old run's checkpoints and rows are gone, the new run's alone stay.
    again = replace(cfg, training={"max_steps": 2, "checkpoint_every": 1})
    Trainer(again, log_to_console=False, overwrite=True).train()
    assert Checkpointer(str(run / "checkpoints")).list() == ["step_00000001", "step_00000002"]
    assert _steps(run) == [1, 2]


def test_metrics_keep_one_row_per_step_across_resumes(finished_run, tmp_path):
    cfg = copy_run(finished_run, tmp_path)
    run = Path(cfg.run.output_dir)
    # Rows logged past the checkpoint by a run that then died (the last one torn mid-write).
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n" + '{"step": 6, "lo')
    longer = replace(cfg, training={"max_steps": 6})
    Trainer(longer, resume=True, log_to_console=False).train()
    Trainer(replace(cfg, training={"max_steps": 8}), resume=True, log_to_console=False).train()
    assert _steps(run) == list(range(1, 9))


@pytest.mark.parametrize("damage", ["truncate", "empty"])
def test_a_damaged_file_falls_back_to_the_newest_intact_checkpoint(
    finished_run, tmp_path, capsys, damage
):
    for name in CHECKPOINT_FILES:
        cfg = copy_run(finished_run, tmp_path / name)
        path = Path(cfg.run.output_dir) / "checkpoints" / "step_00000004" / name
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"")
        capsys.readouterr()
        tr = Trainer(cfg, resume=True, log_to_console=False)
        err = capsys.readouterr().err
        assert tr.step == 2, name
        assert f"step_00000004 is damaged: {name}" in err, err
        assert "resuming from" in err and "step_00000002" in err, err


def test_no_intact_checkpoint_is_refused_naming_the_files(finished_run, tmp_path):
    cfg = copy_run(finished_run, tmp_path)
    ck = Path(cfg.run.output_dir) / "checkpoints"
    (ck / "step_00000004" / "optimizer.safetensors").write_bytes(b"")
    (ck / "step_00000002" / "drafter.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(DFlashError) as e:
        Trainer(cfg, resume=True, log_to_console=False)
    msg = str(e.value)
    assert "no intact checkpoint" in msg
    assert "step_00000004: optimizer.safetensors" in msg
    assert "step_00000002: drafter.safetensors" in msg


@pytest.mark.parametrize("pointer", ["../../elsewhere", "/tmp/step_00000002", "step_00000002/.."])
def test_latest_pointing_outside_the_checkpoints_is_not_followed(
    finished_run, tmp_path, capsys, pointer
):
    cfg = copy_run(finished_run, tmp_path)
    ck = Path(cfg.run.output_dir) / "checkpoints"
    (ck / "LATEST").write_text(pointer + "\n")
    tr = Trainer(cfg, resume=True, log_to_console=False)
    assert tr.step == 4  # the newest step_* directory, found by scanning
    assert "not a step_XXXXXXXX checkpoint of this directory" in capsys.readouterr().err
    with pytest.raises(DFlashError, match="not a checkpoint name"):
        Checkpointer(str(ck)).load(pointer)


def _write_data(path: Path, supervised_every: int, n_docs: int = 40) -> Path:
    """Prepared shards where only every `supervised_every`-th document has supervised tokens
    (0: none has)."""
    rng = np.random.default_rng(0)
    w = ShardWriter(path, "train", shard_tokens=600)
    for i in range(n_docs):
        n = int(rng.integers(60, 120))
        mask = np.zeros(n, dtype=bool)
        if supervised_every and i % supervised_every == 0:
            mask[n // 3 :] = True
        w.add(f"doc{i}", rng.integers(0, VOCAB - 2, n).astype(np.int32), mask)
    entries = w.close()
    split = {
        "documents": n_docs,
        "tokens": sum(e["tokens"] for e in entries),
        "supervised_tokens": sum(e["supervised_tokens"] for e in entries),
        "shards": entries,
    }
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "splits": {"train": split}}
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def _sparse_run(tmp_path: Path) -> tuple[Trainer, list[dict]]:
    """An 8-step run on data where one document in four is supervised: the trained trainer
    and its logged rows (one per step, 1..8)."""
    data = _write_data(tmp_path / "sparse", supervised_every=4)
    cfg = tiny_config(
        tmp_path,
        data={"train": str(data)},
        training={"max_steps": 8, "log_every": 1, "checkpoint_every": 100},
    )
    tr = Trainer(cfg, log_to_console=False)
    tr.train()
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    return tr, rows


def test_unsupervised_documents_take_no_step(tmp_path):
    """The batcher leaves out documents that supervise nothing (test_batching_windows.py):
    no step is spent on them."""
    tr, rows = _sparse_run(tmp_path)
    assert tr.batcher.unsupervised()[0] == 30
    assert rows[-1]["skipped_steps"] == 0 and tr.micro_steps == 8


def test_unsupervised_steps_are_skipped_without_using_up_the_schedule(tmp_path, monkeypatch):
    """A source that cannot say which documents supervise nothing (no first_supervised):
    a step whose anchors have no supervised slot is skipped, the schedule does not advance."""
    monkeypatch.setattr("dflash_trainer.train.trainer.first_supervised_of", lambda _: None)
    tr, rows = _sparse_run(tmp_path)
    assert all(r["loss"] > 0 and r["valid_slots"] > 0 for r in rows), rows
    assert rows[-1]["skipped_steps"] > 0  # the sparse data did produce empty steps
    assert tr.scheduler.last_epoch == 8  # the schedule advanced once per real step
    # Resume replays the same micro-steps: a run resumed at its checkpoint matches.
    assert tr.micro_steps == 8 + rows[-1]["skipped_steps"]


def test_data_that_supervises_nothing_stops_with_a_clear_error(tmp_path):
    data = _write_data(tmp_path / "none", supervised_every=0, n_docs=12)
    cfg = tiny_config(tmp_path, data={"train": str(data)}, training={"max_steps": 4})
    with pytest.raises(DFlashError, match="supervise nothing"):
        Trainer(cfg, log_to_console=False).train()


def test_a_fresh_run_refuses_any_used_run_directory(finished_run, tmp_path):
    """Not only one with checkpoints: metrics, the final drafter or the config mark it used
    (here the checkpoints are gone, or live in another run.checkpoint_dir)."""
    cfg = copy_run(finished_run, tmp_path)
    run = Path(cfg.run.output_dir)
    shutil.rmtree(run / "checkpoints")
    elsewhere = replace(cfg, run={"checkpoint_dir": str(tmp_path / "other-ck")})
    for again in (cfg, elsewhere):
        with pytest.raises(DFlashError) as e:
            Trainer(again, log_to_console=False)
        for name in ("config.yaml", "metrics.jsonl", "drafter", "--resume", "--overwrite"):
            assert name in str(e.value), e.value
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    shutil.copy(run / "config.yaml", only_config)
    with pytest.raises(DFlashError, match=r"already holds a run \(config\.yaml\)"):
        Trainer(replace(cfg, run={"output_dir": str(only_config)}), log_to_console=False)
    # A start that failed before its first step (its config.yaml and run_info.json, an empty
    # metrics.jsonl) is started again by the same command; a metrics row makes it used.
    failed = tmp_path / "failed-start"
    Trainer(replace(cfg, run={"output_dir": str(failed)}), log_to_console=False).release()
    (failed / "metrics.jsonl").write_text("")
    assert {"config.yaml", "run_info.json"} <= {p.name for p in failed.iterdir()}
    Trainer(replace(cfg, run={"output_dir": str(failed)}), log_to_console=False).release()
    (failed / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(DFlashError, match=r"already holds a run \(config\.yaml; run_info"):
        Trainer(replace(cfg, run={"output_dir": str(failed)}), log_to_console=False)
    # --overwrite deletes the old final drafter, but only a drafter this tool wrote.
    (run / "drafter" / "notes.txt").write_text("mine")
    with pytest.raises(DFlashError, match=r"notes\.txt"):
        Trainer(cfg, log_to_console=False, overwrite=True)
    assert (run / "drafter" / "notes.txt").read_text() == "mine"
    (run / "drafter" / "notes.txt").unlink()
    tr = Trainer(replace(cfg, training={"max_steps": 1}), log_to_console=False, overwrite=True)
    assert not (run / "drafter").exists()
    tr.train()
    assert _steps(run) == [1] and (run / "drafter").is_dir()
