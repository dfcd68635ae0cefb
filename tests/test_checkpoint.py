"""Checkpoints: atomic under kill -9, S3 round trip on a loopback server, signals, pruning."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import make_spec
from trainer_utils import tiny_config

from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.train.checkpoint import Checkpointer, CheckpointState
from dflash_trainer.train.run_dir import read_metrics
from dflash_trainer.train.trainer import Trainer


def _save(ck: Checkpointer, step: int, model: torch.nn.Module) -> str:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return ck.save(
        CheckpointState(
            step,
            model.spec,
            model.state_dict(),
            {"step": step},
            opt.state_dict(),
            {"step": step, "position": {"epoch": 0, "step": step}},
            {"x": torch.arange(3)},
        )
    )


def test_round_trip_and_pruning(tmp_path):
    torch.manual_seed(0)
    model = DFlashDrafter(make_spec())
    ck = Checkpointer(str(tmp_path / "ck"), keep_last=2)
    for step in (1, 2, 3):
        _save(ck, step, model)
    assert ck.list() == ["step_00000002", "step_00000003"]
    data = ck.load()
    assert data.name == "step_00000003" and data.trainer_state["step"] == 3
    for k, v in model.state_dict().items():
        assert torch.equal(data.drafter_state[k], v)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(data.optimizer_state)  # loads without pickles
    assert torch.equal(data.rng_tensors["x"], torch.arange(3))


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from conftest import make_spec
    from test_checkpoint import _save
    from dflash_trainer.train.checkpoint import Checkpointer
    from dflash_trainer.core.drafter import DFlashDrafter
    torch.manual_seed(0)
    m = DFlashDrafter(make_spec())
    ck = Checkpointer({root!r})
    _save(ck, int(sys.argv[1]), m)
    """
)


def test_kill_9_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ck"
    script = tmp_path / "save.py"
    script.write_text(KILL_SCRIPT.format(tests=str(Path(__file__).parent), root=str(root)))
    env = {**os.environ}
    subprocess.run([sys.executable, str(script), "1"], check=True, env=env, timeout=120)
    env["DFLASH_CHECKPOINT_PAUSE_S"] = "60"
    proc = subprocess.Popen([sys.executable, str(script), "2"], env=env)
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            partial = list(root.glob(".step_00000002.tmp-*/drafter.safetensors"))
            if partial:
                break
            time.sleep(0.1)
        assert partial, "the second save never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    ck = Checkpointer(str(root))  # also removes the dead save's temporary directory
    assert ck.latest() == "step_00000001"
    assert ck.list() == ["step_00000001"]
    assert not list(root.glob(".*tmp-*"))
    assert ck.load().trainer_state["step"] == 1


@pytest.fixture
def s3_server():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server._server.server_port
    url = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    ).create_bucket(Bucket="dflash-test")
    yield {"endpoint_url": url, "key": "test", "secret": "test"}
    server.stop()


def test_s3_round_trip_on_a_loopback_server(tmp_path, s3_server):
    torch.manual_seed(0)
    model = DFlashDrafter(make_spec())
    ck = Checkpointer("s3://dflash-test/runs/a/checkpoints", keep_last=2, storage_options=s3_server)
    for step in (5, 10, 15):
        loc = _save(ck, step, model)
    assert loc == "s3://dflash-test/runs/a/checkpoints/step_00000015"
    assert ck.list() == ["step_00000010", "step_00000015"]
    again = Checkpointer("s3://dflash-test/runs/a/checkpoints", storage_options=s3_server)
    data = again.load()
    assert data.name == "step_00000015"
    for k, v in model.state_dict().items():
        assert torch.equal(data.drafter_state[k], v)


def test_trainer_checkpoints_to_s3_and_resumes(tmp_path, s3_server):
    cfg = tiny_config(
        tmp_path,
        run={"checkpoint_dir": "s3://dflash-test/runs/t", "storage_options": s3_server},
        training={"max_steps": 4, "checkpoint_every": 2},
    )
    Trainer(cfg, log_to_console=False).train()
    resumed = Trainer(cfg, resume=True, log_to_console=False)
    assert resumed.step == 4


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    cfg = tiny_config(
        tmp_path, training={"max_steps": 100000, "checkpoint_every": 100000, "log_every": 1}
    )
    import yaml

    from dflash_trainer.config import config_to_dict

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_trainer.cli",
            "train",
            "--config",
            str(path),
            "--skip-doctor",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = Path(cfg.run.output_dir)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_metrics(run)) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "checkpoint" in out and "--resume" in out
    step = Checkpointer(str(run / "checkpoints")).load().trainer_state["step"]
    assert step >= 3
    resumed = Trainer(cfg, resume=True, log_to_console=False)
    assert resumed.step == step
