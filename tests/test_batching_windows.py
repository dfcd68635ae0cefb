"""Documents whose kept window (data.max_doc_tokens) supervises nothing: the batcher leaves
them out of every epoch, the trainer and the doctor say how many, and no step is spent on
them (before, a step made only of them was a target forward that trained nothing)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data_support import tiny_tokenizer, write_jsonl
from trainer_utils import tiny_config

from dflash_trainer.core.anchors import eligible_anchors
from dflash_trainer.core.packing import pack_documents
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.shards import PreparedDataset
from dflash_trainer.doctor.data_checks import check_data, load_data_sample
from dflash_trainer.errors import DFlashError
from dflash_trainer.plan.dataset import data_stats
from dflash_trainer.plan.planner import predict
from dflash_trainer.plan.workload import DataStats, step_shape
from dflash_trainer.train.batching import TokenBudgetBatcher, epoch_steps
from dflash_trainer.train.trainer import Trainer


def _first_supervised(mask: list[bool]) -> int:
    return next((i for i, m in enumerate(mask) if i and m), len(mask))


def _rows(n: int, seed: int = 0) -> list[dict[str, list]]:
    """Random rows with the shapes that matter: supervised only at 0, late, early, dense."""
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        length = rng.randint(2, 70)
        mask = [False] * length
        kind = k % 4
        if kind == 0:
            mask[0] = True  # position 0 alone: no anchor has a supervised next token
        elif kind == 1:
            mask[rng.randrange(length // 2, length)] = True
        else:
            for i in range(length):
                mask[i] = rng.random() < (0.1 if kind == 2 else 0.7)
            mask[-1] = True
        rows.append({"input_ids": [rng.randrange(400) for _ in range(length)], "loss_mask": mask})
    return rows


def test_first_supervised_of_a_prepared_dataset_over_many_shards(tmp_path: Path) -> None:
    rows = _rows(160)
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = prepare_dataset(src, tiny_tokenizer(), tmp_path / "prep", eval_fraction=0.0,
                          shard_tokens=300)  # fmt: skip
    ds = PreparedDataset(out, "train")
    assert len(ds._shards) > 5
    first = ds.first_supervised()
    assert first.dtype == np.int64 and first.shape == (len(ds),)
    want = [_first_supervised(d.loss_mask.tolist()) for d in ds.iter_documents()]
    assert first.tolist() == want
    for chunk in (1, 3, 7, 64):  # the mask read in pieces: documents span several of them
        assert np.concatenate([s.first_supervised(chunk) for s in ds._shards]).tolist() == want
    assert any(f == n for f, n in zip(want, ds.lengths.tolist()))  # the "none" case is there


def test_an_epoch_leaves_out_exactly_the_documents_unsupervised_in_their_window() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 90, 400)
    first = np.minimum(rng.integers(1, 120, 400), lengths)
    limit = 40
    kept = {i for i in range(400) if first[i] < min(lengths[i], limit) and lengths[i] >= 2}
    assert 50 < len(kept) < 350  # both kinds are there
    steps = epoch_steps(lengths, 128, limit, seed=3, epoch=1, first_supervised=first)
    seen = [i for s in steps for i in s]
    assert sorted(seen) == sorted(kept)  # each kept document once, no other
    every = epoch_steps(lengths, 128, limit, seed=3, epoch=1)
    assert len({i for s in every for i in s}) > len(kept)  # without it, all of them
    b = TokenBudgetBatcher(lengths, 128, limit, seed=3, first_supervised=first)
    n, tokens = b.unsupervised()
    gone = [i for i in range(400) if min(lengths[i], limit) >= 2 and i not in kept]
    assert n == len(gone) and tokens == int(np.minimum(lengths[gone], limit).sum())
    assert f"{n:,} of 400 training documents" in (b.unsupervised_note() or "")


def test_every_step_of_a_run_has_an_anchor_and_the_run_says_what_it_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tiny_config's documents supervise their last two thirds: with a 16-token window the
    longer ones supervise nothing inside it."""
    cfg = tiny_config(tmp_path, data={"max_doc_tokens": 16, "token_budget": 32},
                      training={"max_steps": 6, "log_every": 1})  # fmt: skip
    ds = PreparedDataset(cfg.data.train, "train")
    first, lengths = ds.first_supervised(), ds.lengths
    out = int(((first >= np.minimum(lengths, 16)) & (lengths >= 2)).sum())
    assert 0 < out < len(ds)
    tr = Trainer(cfg, log_to_console=True)
    for epoch in range(2):  # the packs the trainer builds: each has an eligible anchor
        for step in tr.batcher._epoch(epoch):
            docs = [ds[i] for i in step]
            ids = [torch.from_numpy(d.input_ids[:16].astype(np.int64)) for d in docs]
            pack = pack_documents(ids, [torch.from_numpy(d.loss_mask[:16]) for d in docs])
            assert bool(eligible_anchors(pack).any())
    tr.train()
    said = capsys.readouterr().out
    assert f"{out:,} of {len(ds):,} training documents" in said and "within their first 16" in said
    assert "no supervised slot" not in said


def test_the_doctor_says_how_many_documents_the_window_leaves_out(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, data={"max_doc_tokens": 16, "token_budget": 32})
    checks = {c.id: c for c in check_data(cfg, load_data_sample(cfg.data.train))}
    assert checks["data.windows"].status == "warn"
    assert "supervise nothing within their first 16 tokens" in checks["data.windows"].message
    rows = [{"input_ids": list(range(30)), "loss_mask": [i == 0 or i > 20 for i in range(30)]},
            {"input_ids": list(range(8)), "loss_mask": [False] * 7 + [True]}]  # fmt: skip
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    sample = load_data_sample(jsonl)
    assert sample.first_supervised is not None
    assert sample.first_supervised.tolist() == [21, 7]
    wide = tiny_config(tmp_path, data={"max_doc_tokens": 64, "token_budget": 64})
    checks = {c.id: c for c in check_data(wide, sample)}
    assert checks["data.windows"].status == "pass"


def test_a_window_that_leaves_nothing_is_an_error_naming_the_limit(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, data={"max_doc_tokens": 4, "token_budget": 32})
    checks = {c.id: c for c in check_data(cfg, load_data_sample(cfg.data.train))}
    assert checks["data.windows"].status == "fail"
    assert checks["data.anchors"].status == "skip"  # not a median of nothing
    with pytest.raises(DFlashError, match=r"40 of 40 training documents .* first 4 tokens"):
        Trainer(cfg, log_to_console=False)


def test_a_checkpoint_of_another_epoch_plan_is_resumed_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint written before documents that supervise nothing were left out (no count
    recorded) continues, saying that the order of the rest of the run changed."""
    cfg = tiny_config(tmp_path, data={"max_doc_tokens": 16, "token_budget": 32},
                      training={"max_steps": 4, "checkpoint_every": 2})  # fmt: skip
    Trainer(cfg, log_to_console=False).train()
    step = Path(cfg.run.output_dir) / "checkpoints" / "step_00000004"
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["left_out_docs"] == 21
    capsys.readouterr()
    assert Trainer(cfg, resume=True, log_to_console=False).step == 4
    assert "another order" not in capsys.readouterr().err  # the same plan: nothing to say
    del state["left_out_docs"]  # as an older version wrote it
    (step / "checksums.json").unlink()
    (step / "trainer_state.json").write_text(json.dumps(state))
    assert Trainer(cfg, resume=True, log_to_console=False).step == 4
    err = capsys.readouterr().err
    assert "step_00000004 was written by a run that kept them in its epochs" in err, err
    assert "leaves out 21 documents" in err
    state["left_out_docs"] = "21"  # not a count: the checkpoint is damaged, the older one used
    (step / "trainer_state.json").write_text(json.dumps(state))
    assert Trainer(cfg, resume=True, log_to_console=False).step == 2
    assert "left_out_docs is '21', not a count" in capsys.readouterr().err


def test_the_planner_replays_the_epoch_the_trainer_runs(tmp_path: Path) -> None:
    """`dflash plan` on data whose window leaves documents out: its steps per epoch and its
    documents and tokens per step are those of the trainer's epoch plan, not of every
    document; where no document is left, it says so instead of planning nothing."""
    cfg = tiny_config(tmp_path, data={"max_doc_tokens": 16, "token_budget": 32})
    tr = Trainer(cfg, log_to_console=False)
    tr.release()
    assert tr.batcher.unsupervised()[0] > 0
    steps = tr.batcher._epoch(0)
    stats = data_stats(cfg)
    assert stats.documents == len(tr.batcher.lengths)
    for compile in (False, True):  # the unpadded step and the fast step's fixed shapes
        shape = step_shape(stats, cfg, tr.spec, compile)
        assert shape.steps_per_epoch == len(steps) == tr.batcher.steps_per_epoch
        assert shape.docs == pytest.approx(np.mean([len(s) for s in steps]))
        tokens = [int(np.minimum(tr.batcher.lengths[s], 16).sum()) for s in steps]
        assert shape.target_tokens == pytest.approx(np.mean(tokens))
    hf = tr.target.model.config
    pred = predict(cfg, "h100", gpus=1, data=stats, compile=False, target_hf_config=hf)
    assert pred.steps_per_epoch == tr.batcher.steps_per_epoch
    # Without the masks (the manifest's counts alone) every document is taken as supervised.
    blind = DataStats(stats.documents, stats.lengths, stats.mean_tokens, 0.5, "lengths only")
    assert step_shape(blind, cfg, tr.spec, False).steps_per_epoch > len(steps)
    narrow = tiny_config(tmp_path, data={"max_doc_tokens": 4, "token_budget": 32})
    with pytest.raises(DFlashError, match=r"no step to plan: .* within its first 4 tokens"):
        step_shape(data_stats(narrow), narrow, tr.spec, False)
