"""The training loop on CPU: loss falls, exact resume, checkpoints, NaN handling, truncation."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from trainer_utils import stop_after_checkpoint, tiny_config, write_prepared

from dflash_trainer.errors import DFlashError
from dflash_trainer.train.checkpoint import Checkpointer
from dflash_trainer.train.run_dir import read_metrics
from dflash_trainer.train.trainer import Trainer


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


def test_training_runs_and_loss_falls(tmp_path):
    data = write_prepared(tmp_path / "count", learnable=True)
    cfg = tiny_config(
        tmp_path,
        data={"train": str(data)},
        training={
            "max_steps": 60,
            "log_every": 10,
            "checkpoint_every": 100,
            "labels": "data",
            "lr": 1e-2,
            "warmup_ratio": 0.0,
        },
    )
    out = Trainer(cfg, log_to_console=False).train()
    assert out["step"] == 60
    recs = read_metrics(cfg.run.output_dir)
    assert [r["step"] for r in recs] == [10, 20, 30, 40, 50, 60]
    assert recs[-1]["loss"] < 0.6 * recs[0]["loss"]
    assert recs[-1]["exact_tau"] > 1.8
    for key in (
        "exact_tau",
        "expected_tau",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "target_time_s",
        "drafter_time_s",
        "slot_acc",
        "accuracy",
    ):
        assert key in recs[-1]
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "run_info.json").is_file()
    info = json.loads((run / "run_info.json").read_text())
    assert "torch" in info["versions"] and "argv" in info
    assert (run / "drafter" / "drafter.safetensors").is_file()
    assert (run / "plots" / "loss.png").is_file() and (run / "plots" / "tau.png").is_file()
    assert Checkpointer(str(run / "checkpoints")).latest() == "step_00000060"


def test_resume_is_bit_exact(tmp_path):
    full = tiny_config(tmp_path, run={"output_dir": str(tmp_path / "full")})
    Trainer(full, log_to_console=False).train()
    part = tiny_config(tmp_path, run={"output_dir": str(tmp_path / "part")})
    # Stop right after the step-4 checkpoint, as a SIGTERM between steps would.
    stop_after_checkpoint(part)
    # A fresh process-equivalent: new Trainer, resume from the run directory.
    resumed = Trainer(part, resume=True, log_to_console=False)
    assert resumed.step == 4
    resumed.train()
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert [s for s, _ in a] == [s for s, _ in b] == [2, 4, 6, 8]
    assert a == b  # bit-exact, not approximately equal


def test_resume_refuses_another_world_size(tmp_path):
    cfg = tiny_config(tmp_path, training={"max_steps": 2, "checkpoint_every": 1})
    Trainer(cfg, log_to_console=False).train()
    ck = tmp_path / "run" / "checkpoints" / "step_00000002" / "trainer_state.json"
    st = json.loads(ck.read_text())
    st["world_size"] = 2
    ck.write_text(json.dumps(st))
    # As a 2-rank run would have written it: its checksum matches.
    sums_file = ck.parent / "checksums.json"
    sums = json.loads(sums_file.read_text())
    sums["sha256"][ck.name] = hashlib.sha256(ck.read_bytes()).hexdigest()
    sums_file.write_text(json.dumps(sums))
    with pytest.raises(DFlashError, match="written by a run with 2 ranks; this run has 1"):
        Trainer(cfg, resume=True, log_to_console=False)


def test_nan_steps_are_skipped_then_stop_the_run(tmp_path):
    cfg = tiny_config(
        tmp_path, training={"max_steps": 20, "checkpoint_every": 2, "max_bad_steps": 3}
    )
    tr = Trainer(cfg, log_to_console=False)
    good = {k: v.clone() for k, v in tr.drafter.state_dict().items()}
    for _ in range(2):
        tr.train_step()
    tr.save_checkpoint()
    saved = {k: v.clone() for k, v in tr.drafter.state_dict().items()}
    assert any(not torch.equal(good[k], saved[k]) for k in good)
    # Poison the drafter input: every later loss is NaN.
    tr.drafter.fc.weight.data[0, 0] = math.nan
    with pytest.raises(DFlashError, match="3 consecutive non-finite steps"):
        tr.train()
    assert tr.skipped_total == 3
    latest = Checkpointer(str(tmp_path / "run" / "checkpoints")).load()
    assert latest.name == "step_00000002"
    for k, v in latest.drafter_state.items():
        assert torch.equal(v, saved[k])


def test_non_finite_weights_never_replace_the_last_good_checkpoint(tmp_path):
    tr = Trainer(tiny_config(tmp_path, training={"max_steps": 4}), log_to_console=False)
    tr.train_step()
    tr.save_checkpoint()
    tr.train_step()
    tr.drafter.fc.weight.data[0, 0] = math.nan
    with pytest.raises(DFlashError, match=r"step 2: .* non-finite weights.*\(step_00000001\)"):
        tr.save_checkpoint()
    assert tr.checkpointer.latest() == "step_00000001"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == [
        "step_00000001"
    ]
    tr.release()


def test_a_run_shorter_than_max_bad_steps_with_every_step_non_finite_fails(tmp_path):
    cfg = tiny_config(tmp_path, training={"max_steps": 2, "max_bad_steps": 5})
    tr = Trainer(cfg, log_to_console=False)
    tr.drafter.fc.weight.data[0, 0] = math.nan  # every loss NaN from the first step
    with pytest.raises(DFlashError, match="every step of this run"):
        tr.train()
    assert tr.skipped_total == 2
    assert not (tmp_path / "run" / "drafter").exists()


def test_long_documents_are_truncated_and_counted(tmp_path):
    data = write_prepared(tmp_path / "long", n_docs=10, lo=150, hi=200)
    cfg = tiny_config(
        tmp_path,
        data={"train": str(data), "token_budget": 256, "max_doc_tokens": 100},
        training={"max_steps": 4, "log_every": 4},
    )
    Trainer(cfg, log_to_console=False).train()
    rec = read_metrics(tmp_path / "run")[-1]
    # Every document is over 100 tokens; 2 fit per 256-token step: 8 truncated in 4 steps.
    assert rec["truncated_docs"] == 8
    assert rec["tokens_seen"] == 8 * 100


def test_kl_dpace_and_data_labels_paths_train(tmp_path):
    for i, changes in enumerate(
        [
            {"loss": "kl"},
            {"weighting": "dpace"},
            {"labels": "data"},
            {"grad_accum_steps": 2},
        ]
    ):
        cfg = tiny_config(
            tmp_path,
            run={"output_dir": str(tmp_path / f"r{i}")},
            training={"max_steps": 3, "log_every": 3, **changes},
        )
        Trainer(cfg, log_to_console=False).train()
        assert math.isfinite(read_metrics(tmp_path / f"r{i}")[-1]["loss"])


def test_unpacked_baseline_runs_one_forward_per_document(tmp_path):
    cfg = tiny_config(tmp_path, training={"max_steps": 2, "log_every": 2, "pack_documents": False})
    tr = Trainer(cfg, log_to_console=False)
    st = tr.train_step()
    assert math.isfinite(st.loss) and st.tokens > 0


def test_pairs_prefetch_gives_the_same_losses_as_colocated(tmp_path):
    # A degenerate pair (both roles on one device): the prefetch thread must not change
    # the data order, the anchors or the noise.
    a = tiny_config(tmp_path, run={"output_dir": str(tmp_path / "colo")})
    b = tiny_config(
        tmp_path, run={"output_dir": str(tmp_path / "pairs")}, distributed={"placement": "pairs"}
    )
    Trainer(a, log_to_console=False).train()
    tr = Trainer(b, log_to_console=False)
    tr.train()
    assert tr.prefetch is not None and tr.prefetch.thread is not None
    assert losses(tmp_path / "colo") == losses(tmp_path / "pairs")


@pytest.mark.gpu
def test_compiled_training_on_gpu_and_degenerate_pair_match(tmp_path):
    # The compiled FlexAttention path of the real trainer, and `pairs` on one GPU (both
    # roles on cuda:0, target stage prefetched in a thread) giving the same losses.
    common = {
        "device": "cuda",
        "compile": True,
        "precision": "bf16",
        "max_steps": 6,
        "log_every": 1,
        "checkpoint_every": 100,
    }
    # Compiled FlexAttention needs a head dim of at least 16 (the CPU tests use 8).
    drafter = {"head_dim": 16}
    a = tiny_config(
        tmp_path, run={"output_dir": str(tmp_path / "colo")}, training=common, drafter=drafter
    )
    b = tiny_config(
        tmp_path,
        run={"output_dir": str(tmp_path / "pairs")},
        training=common,
        drafter=drafter,
        distributed={"placement": "pairs"},
    )
    Trainer(a, log_to_console=False).train()
    Trainer(b, log_to_console=False).train()
    la, lb = losses(tmp_path / "colo"), losses(tmp_path / "pairs")
    assert len(la) == 6 and all(math.isfinite(x) for _, x in la)
    # Same data, anchors and noise; cuBLAS handles are per thread and may pick other
    # algorithms, so equality is to bf16 noise, not bitwise.
    for (sa, xa), (sb, xb) in zip(la, lb):
        assert sa == sb and abs(xa - xb) <= 2e-2 * abs(xa), (la, lb)


def test_in_training_eval_walks_the_held_out_split(tmp_path):
    data = write_prepared(tmp_path / "count", learnable=True)
    cfg = tiny_config(
        tmp_path,
        data={"train": str(data)},
        training={"max_steps": 10, "log_every": 10, "checkpoint_every": 100},
        eval={"train_walk_docs": 6},
    )
    trainer = Trainer(cfg, log_to_console=False)
    trainer.train()
    ev = trainer.in_training_eval
    assert ev.heldout_walk(trainer.drafter, trainer.target) is None  # no eval split here
    ev.held_out = trainer.data.train  # a split of real prepared documents
    walk = ev.heldout_walk(trainer.drafter, trainer.target)
    assert walk is not None and walk["documents"] == 6 and walk["steps"] > 0
    assert 1.0 <= walk["tau"] <= cfg.drafter.block_size
    assert trainer.drafter.training  # the walk restores the training mode


def test_dflash2_trains_logs_its_terms_and_starts_from_a_dflash_drafter(tmp_path):
    """A DFlash run, then a DFlash2 run initialised from it: the backbone is copied, the new
    modules start as no-ops, the selector's terms are logged and plotted."""
    base = tiny_config(
        tmp_path,
        training={"max_steps": 4, "log_every": 2},
        run={"output_dir": str(tmp_path / "v1")},
    )
    Trainer(base, log_to_console=False).train()
    d2 = {"kind": "dflash2", "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
    cfg = tiny_config(
        tmp_path,
        drafter={**d2, "init_from": str(tmp_path / "v1")},
        training={"max_steps": 4, "log_every": 2, "lk_weight": 0.2},
        run={"output_dir": str(tmp_path / "v2")},
    )
    tr = Trainer(cfg, log_to_console=False)
    from dflash_trainer.formats.drafter_io import load_drafter

    _, v1_state, _ = load_drafter(tmp_path / "v1")
    mine = tr.drafter.state_dict()
    for k, v in v1_state.items():
        assert torch.equal(mine[k].cpu(), v.float()), k
    for layer in tr.drafter.layers:
        assert bool((layer.attention_conv.kernel_projection.weight == 0).all())
    assert bool((tr.drafter.candidate_selector.successor_codebook == 0).all())
    tr.train()
    rec = read_metrics(tmp_path / "v2")[-1]
    for key in ("selector_loss", "candidate_recall", "selector_tau", "oracle_tau", "lk_tau"):
        assert math.isfinite(rec[key]), key
    assert 1.0 <= rec["selector_tau"] <= rec["oracle_tau"] <= 4.0
    assert (tmp_path / "v2" / "plots" / "dflash2.png").is_file()
    # The selector trained: the successor codebook left zero.
    assert float(tr.drafter.candidate_selector.successor_codebook.detach().abs().sum()) > 0
    # A DFlash2 drafter cannot start a DFlash run.
    bad = tiny_config(
        tmp_path,
        drafter={"init_from": str(tmp_path / "v2")},
        run={"output_dir": str(tmp_path / "v3")},
    )
    with pytest.raises(DFlashError, match="kind"):
        Trainer(bad, log_to_console=False)
