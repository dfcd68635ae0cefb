"""The fast step (train/fast_step.py) against the standard step, on CPU in fp32.

Tolerance: the fast step computes the same sums in a different arrangement (target rows
shared by several documents under a block-diagonal mask, all N*B slots through the
lm_head with padding masked), so fp32 results agree to float rounding, not bit for bit:
losses within rel 1e-5, gradient norms within rel 1e-4 (measured: equal to 1e-7).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_spec
from trainer_utils import tiny_config

from dflash_trainer.core.dflash2 import CandidateSelector
from dflash_trainer.core.loss import DFlash2Inputs, Objective, dflash_loss
from dflash_trainer.core.masks import intervals_to_dense
from dflash_trainer.errors import DFlashError
from dflash_trainer.train.fast_layout import (
    FastShapes,
    build_chunks,
    layout_cost,
    layout_rows,
    whole_pack_cost,
)
from dflash_trainer.train.fast_loss import fixed_shape_loss
from dflash_trainer.train.fast_step import resolve_step_path
from dflash_trainer.train.fast_target import TargetRunner, chunk_intervals
from dflash_trainer.train.step import run_target, settings_for_spec
from dflash_trainer.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(cfg, steps: int) -> tuple[Trainer, list]:
    tr = Trainer(cfg, log_to_console=False)
    return tr, [tr.train_step() for _ in range(steps)]


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


DFLASH2 = {"kind": "dflash2", "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
EXTRA = ("lk_loss", "lk_tau", "selector_loss", "candidate_recall", "selector_tau", "oracle_tau")


def _same_steps(std: list, fast: list) -> None:
    for i, (s, f) in enumerate(zip(std, fast)):
        assert s.tokens == f.tokens and s.truncated == f.truncated, i
        assert _close(s.loss, f.loss, 1e-5), (i, s.loss, f.loss)
        assert _close(s.grad_norm, f.grad_norm, 1e-4), (i, s.grad_norm, f.grad_norm)
        assert set(s.metrics) == set(f.metrics)
        for k in ("accuracy", "exact_tau", "expected_tau", "anchors", "valid_slots", *EXTRA):
            if k in s.metrics:
                assert _close(float(s.metrics[k]), float(f.metrics[k]), 1e-5), (i, k)
        assert torch.allclose(s.metrics["slot_acc"].cpu(), f.metrics["slot_acc"], atol=1e-6)
        assert s.skipped == f.skipped


@pytest.mark.parametrize(
    "training",
    [
        {},  # the recipe's default: ce on target labels, decay weights, noise 0.05
        {"loss": "kl"},
        {"labels": "data", "weighting": "dpace"},
        {"grad_accum_steps": 2},
        {"target_attention": "flex"},  # the target's rows as one sequence under a block mask
        {"lk_weight": 0.5},
        {"loss": "lk"},
        {"drafter": DFLASH2},
        {"drafter": DFLASH2, "weighting": "dpace", "grad_accum_steps": 2},
    ],
    ids=["ce", "kl", "data-dpace", "accum2", "flex-target", "ce+lk", "lk", "dflash2", "dflash2-dp"],
)
def test_fast_step_matches_standard(tmp_path, training):
    runs = {}
    training = dict(training)
    drafter = training.pop("drafter", {})
    for path in ("standard", "fast"):
        cfg = tiny_config(
            tmp_path,
            training={**training, "step_path": path},
            drafter=drafter,
            run={"output_dir": str(tmp_path / path)},
        )
        tr, stats = _run(cfg, 3)
        assert (tr.fast is None) == (path == "standard")
        runs[path] = (tr, stats)
    _same_steps(runs["standard"][1], runs["fast"][1])
    # The same updates: the weights after three steps agree too. FlexAttention's reference
    # path sums the target's attention in another order (features agree to 1e-6 relative);
    # Adam divides each gradient by its own scale, so where a gradient is near zero that
    # rounding moves the update by a visible share of lr (3e-3): measured 1.7e-5 at most.
    atol = 1e-4 if training.get("target_attention") == "flex" else 1e-6
    std, fast = runs["standard"][0].drafter.state_dict(), runs["fast"][0].drafter.state_dict()
    for k in std:
        assert torch.allclose(std[k], fast[k], rtol=1e-4, atol=atol), k


def test_fast_resume_matches_uninterrupted(tmp_path):
    def cfg(name: str, steps: int):
        return tiny_config(
            tmp_path,
            training={"step_path": "fast", "max_steps": steps, "checkpoint_every": 3},
            run={"output_dir": str(tmp_path / name)},
        )

    full = Trainer(cfg("full", 6), log_to_console=False)
    full_stats = [full.train_step() for _ in range(6)]
    part = Trainer(cfg("part", 6), log_to_console=False)
    for _ in range(3):
        part.train_step()
    part.save_checkpoint()
    resumed = Trainer(cfg("part", 6), resume=True, log_to_console=False)
    assert resumed.step == 3 and resumed.fast is not None
    rest = [resumed.train_step() for _ in range(3)]
    for a, b in zip(full_stats[3:], rest):
        assert a.tokens == b.tokens
        assert a.loss == b.loss and a.grad_norm == b.grad_norm  # the same process: exact
    for k, v in full.drafter.state_dict().items():
        assert torch.equal(v, resumed.drafter.state_dict()[k]), k


def test_default_cpu_path_is_standard(tmp_path):
    cfg = tiny_config(tmp_path)
    assert cfg.training.step_path == "auto"
    tr = Trainer(cfg, log_to_console=False)
    assert tr.fast is None
    path, why = resolve_step_path(cfg, tr.target, 1, torch.device("cpu"))
    assert (path, why) == ("standard", "auto: not on a GPU")
    # On a GPU, auto would take the fast step for this (full-attention, tiny) target.
    assert resolve_step_path(cfg, tr.target, 1, torch.device("cuda"))[0] == "fast"
    assert resolve_step_path(cfg, tr.target, 2, torch.device("cuda"))[0] == "standard"


def test_fast_refused_where_it_cannot_run(tmp_path):
    cfg = tiny_config(tmp_path, training={"step_path": "fast", "pack_documents": False})
    with pytest.raises(DFlashError, match=r"training\.step_path=fast: training\.pack_documents"):
        Trainer(cfg, log_to_console=False)


def test_shared_rows_give_the_standard_features(tmp_path):
    """Several documents per target row (block-diagonal mask) = one row per document."""
    cfg = tiny_config(tmp_path, training={"step_path": "fast"})
    tr = Trainer(cfg, log_to_console=False)
    assert tr.fast is not None
    hs = tr.fast.host_step(0, tr.position)
    docs, _ = tr._documents(tr.position)
    st = settings_for_spec(cfg, tr.spec, True)
    ref = run_target(tr.target, docs, st)
    shapes = tr.fast.shapes
    assert any(len(r.docs) > 1 for r in layout_rows([int(d[0].numel()) for d in docs], shapes))
    for multi in (True, False):
        sh = FastShapes(shapes.ctx_len, shapes.anchors, shapes.row_lengths, 512, multi)
        runner = TargetRunner(tr.target, sh, need_final=True, graphs=False)
        ids = [d[0] for d in docs]
        rows = layout_rows([int(x.numel()) for x in ids], sh)
        starts = torch.cumsum(torch.tensor([0] + [int(x.numel()) for x in ids]), 0).tolist()
        runner.run(build_chunks(rows, ids, starts, sh))
        n = hs.tokens
        assert runner.final is not None
        torch.testing.assert_close(runner.feat[:n], ref.features_TF[:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.final[:n], ref.final_hidden_TH[:n], rtol=1e-5, atol=1e-5)
        assert bool((runner.feat[n : shapes.ctx_len] == 0).all())  # pack padding reads zeros


def test_flex_target_rule_is_the_dense_rule():
    """chunk_intervals, drawn densely, is the block-diagonal causal mask of every row."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows, length = 3, 128
        seg = torch.full((rows, length), -1, dtype=torch.long)
        doc = 0
        for r in range(rows):
            off = 0
            while off < length and torch.rand((), generator=gen) < 0.8:
                n = int(torch.randint(1, length - off + 1, (), generator=gen))
                seg[r, off : off + n] = doc
                doc, off = doc + 1, off + n
        dense = intervals_to_dense(chunk_intervals(seg))
        flat = seg.reshape(-1)
        n = flat.numel()
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        same_row = q // length == k // length
        want = same_row & (k <= q) & (flat[:, None] == flat[None, :]) & (flat[None, :] >= 0)
        assert torch.equal(dense, want | torch.eye(n, dtype=torch.bool))


def test_flex_target_leaves_the_attention_setting_as_it_was(tmp_path):
    cfg = tiny_config(tmp_path, training={"step_path": "fast", "target_attention": "flex"})
    tr = Trainer(cfg, log_to_console=False)
    before = tr.target.model.config._attn_implementation
    tr.train_step()
    assert tr.fast is not None and tr.fast.runner.flex
    assert tr.target.model.config._attn_implementation == before
    assert "target attention flex" in tr.fast.describe()


def test_flex_target_on_the_standard_step_is_said_to_do_nothing(tmp_path):
    from dflash_trainer.train.fast_step import build_fast_step

    cfg = tiny_config(tmp_path, training={"target_attention": "flex"})
    tr = Trainer(cfg, log_to_console=False)
    fast, line = build_fast_step(tr)
    assert fast is None and "target_attention=flex applies to the fast step only" in line


def test_flex_target_refuses_a_big_pack_off_the_gpu(tmp_path):
    cfg = tiny_config(tmp_path, training={"step_path": "fast"})
    tr = Trainer(cfg, log_to_console=False)
    big = FastShapes(65536, 64, (128, 256), 1024, True)
    with pytest.raises(DFlashError, match="target_attention=dense off the GPU"):
        TargetRunner(tr.target, big, need_final=False, graphs=False, flex=True)


def test_whole_pack_cost_counts_the_tiles_each_query_block_reaches():
    # Blocks of 128: doc 0 fills block 0, doc 1 blocks 1-2, block 3 is padding.
    assert whole_pack_cost([128, 256], 512) == (512, 5 * 128 * 128, 1, 512.0)
    # A document straddling a block boundary pulls the next block back to its start.
    padded, pairs, chunks, _ = whole_pack_cost([100, 100], 256)
    assert (padded, pairs, chunks) == (256, 3 * 128 * 128, 1)
    # Against the dense rows, on many short documents: far fewer pairs.
    shapes = FastShapes(65536, 64, (128, 256, 512, 1024, 2048, 4096), 16384, True)
    lengths = [300, 900, 150, 2500, 700, 1200, 400] * 9
    assert whole_pack_cost(lengths, 65536)[1] < layout_cost(lengths, shapes)[1] / 2


def test_layout_places_every_token_once():
    shapes = FastShapes(32768, 64, (128, 256, 512), 1024, True)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 513, (40,), generator=g).tolist()
    rows = layout_rows(lengths, shapes)
    assert all(r.used <= r.length for r in rows)
    assert sum(r.used for r in rows) == sum(lengths)
    for r in rows:  # a row's first (longest) document opened it: the shortest bucket for it
        first = lengths[r.docs[0][0]]
        assert r.docs[0][1] == 0
        assert r.length == min(b for b in shapes.row_lengths if b >= first)
    assert sum(lengths) / sum(r.length for r in rows) > 0.8  # shared rows fill up
    ids = [torch.full((n,), i) for i, n in enumerate(lengths)]
    starts = torch.cumsum(torch.tensor([0, *lengths]), 0).tolist()
    chunks = build_chunks(rows, ids, starts, shapes)
    assert {c.shape for c in chunks} <= {
        (r, length) for length in shapes.row_lengths for r in shapes.chunk_row_counts(length)
    }
    dst = torch.cat([c.dst_RL.reshape(-1) for c in chunks])
    real = dst[dst < shapes.ctx_len]
    assert sorted(real.tolist()) == list(range(sum(lengths)))
    # Each token's id is its document's, at its packed place.
    packed = torch.zeros(sum(lengths), dtype=torch.long)
    for c in chunks:
        keep = c.dst_RL < shapes.ctx_len
        packed[c.dst_RL[keep]] = c.ids_RL[keep]
    assert torch.equal(packed, torch.cat(ids))


@pytest.mark.parametrize(
    ("weighting", "kl", "extra"),
    [
        ("decay", False, None),
        ("dpace", False, None),
        ("decay", True, None),
        ("decay", False, "lk"),
        ("dpace", False, "dflash2"),
    ],
)
def test_fixed_shape_loss_equals_dflash_loss(weighting, kl, extra):
    spec = make_spec()
    g = torch.Generator().manual_seed(1)
    n, b, h, v = 8, spec.block_size, spec.hidden_size, spec.vocab_size
    hidden = torch.randn(n, b, h, generator=g, requires_grad=True)
    w = torch.randn(v, h, generator=g) * 0.3
    valid = torch.rand(n, b, generator=g) < 0.6
    valid[:, 0] = False
    valid[6:] = False  # padding anchors
    real = torch.arange(n) < 6
    labels = torch.randint(0, v, (n, b), generator=g)
    th = torch.randn(n, b, h, generator=g) if kl else None
    kw: dict = dict(labels_NB=None if kl else labels, target_hidden_NBH=th, weighting=weighting)
    if extra == "lk":
        kw["target_hidden_NBH"] = torch.randn(n, b, h, generator=g)
        kw["objective"] = Objective("ce", weighting, chunk_rows=5, lk_weight=0.7)
    if extra == "dflash2":
        torch.manual_seed(0)
        sel = CandidateSelector(h, v, 6)
        with torch.no_grad():
            sel.successor_codebook.normal_()
        kw["objective"] = Objective("ce", weighting, chunk_rows=5, top_k=5)
        kw["dflash2"] = DFlash2Inputs(sel, torch.randint(0, v, (n,), generator=g), hidden)
    ref = dflash_loss(hidden, w, valid, real, chunk_rows=5, **kw)
    (g_ref,) = torch.autograd.grad(ref.loss, hidden)
    out = fixed_shape_loss(hidden, w, valid, real, chunk_rows=5, **kw)
    (g_out,) = torch.autograd.grad(out.loss, hidden)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_out, g_ref, rtol=1e-5, atol=1e-7)
    for k, val in ref.metrics.items():
        torch.testing.assert_close(out.metrics[k].float(), val.float(), rtol=1e-6, atol=1e-6)


def test_fixed_shape_loss_with_no_valid_slot_is_zero():
    hidden = torch.randn(4, 4, 8, requires_grad=True)
    w = torch.randn(11, 8)
    valid = torch.zeros(4, 4, dtype=torch.bool)
    out = fixed_shape_loss(
        hidden, w, valid, torch.zeros(4, dtype=torch.bool), torch.zeros(4, 4, dtype=torch.long)
    )
    assert float(out.loss.detach()) == 0.0
    out.loss.backward()
    assert hidden.grad is not None and bool((hidden.grad == 0).all())


def test_non_finite_step_is_skipped_on_the_device(tmp_path):
    """The fused AdamW skips the update (and its step count) from a device flag."""
    cfg = tiny_config(tmp_path, training={"step_path": "fast"})
    tr = Trainer(cfg, log_to_console=False)
    assert tr.fast is not None
    tr.optimizer = torch.optim.AdamW(tr.drafter.parameters(), lr=1e-2, fused=True)
    for p in tr.drafter.parameters():
        p.grad = torch.ones_like(p)
    before = {k: v.clone() for k, v in tr.drafter.state_dict().items()}
    _, finite = tr.fast.optimizer_stage(torch.tensor(float("nan")))
    assert not bool(finite)
    for k, v in tr.drafter.state_dict().items():
        assert torch.equal(v, before[k]), k
    steps = [s["step"] for s in tr.optimizer.state.values()]
    assert all(float(s) == 0 for s in steps)
    _, finite = tr.fast.optimizer_stage(torch.tensor(1.0))
    assert bool(finite)
    assert any(not torch.equal(v, before[k]) for k, v in tr.drafter.state_dict().items())


def test_documents_past_the_pack_are_refused_on_the_host():
    """A layout whose tokens end past ctx_len would index out of bounds inside a CUDA graph
    (a device assert that poisons the process): refused before anything reaches the GPU."""
    shapes = FastShapes(256, 64, (128, 256), 1024, True)
    lengths = [100, 90, 80]
    ids = [torch.full((n,), 1) for n in lengths]
    starts = torch.cumsum(torch.tensor([0, *lengths]), 0).tolist()
    with pytest.raises(ValueError, match="past the pack of 256"):
        build_chunks(layout_rows(lengths, shapes), ids, starts, shapes)
    assert build_chunks(layout_rows(lengths[:2], shapes), ids[:2], starts[:3], shapes)
