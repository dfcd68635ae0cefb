"""The fast step on CUDA: bf16 agreement with the standard step, CUDA graphs, no host waits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from trainer_utils import tiny_config, write_tiny_target

from dflash_trainer.core.packing import pack_documents
from dflash_trainer.train.fast_layout import build_chunks, layout_rows, pack_chunk
from dflash_trainer.train.fast_target import TargetRunner
from dflash_trainer.train.trainer import Trainer

pytestmark = pytest.mark.gpu


def cuda_config(tmp_path, name: str, target: Path | None = None, **training):
    # head_dim 16: compiled FlexAttention on CUDA has no smaller kernel (`target`: a tiny
    # target of wider heads, for the tests that run the target through it too).
    where = {"name_or_path": str(target)} if target is not None else {}
    return tiny_config(
        tmp_path,
        target={"dtype": "bfloat16", **where},
        drafter={"head_dim": 16},
        training={"device": "cuda", "precision": "bf16", **training},
        run={"output_dir": str(tmp_path / name)},
    )


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_cuda_fast_matches_standard_in_bf16(tmp_path, compile):
    """Same documents, anchors and noise; bf16 rounding differs (other row batching)."""
    # Uncompiled, the standard pack follows the data (another noise shape): no noise then.
    noise = 0.05 if compile else 0.0
    runs = {}
    for path in ("standard", "fast"):
        cfg = cuda_config(tmp_path, path, step_path=path, compile=compile, noise_std=noise)
        tr = Trainer(cfg, log_to_console=False)
        assert (tr.fast is None) == (path == "standard")
        runs[path] = [tr.train_step() for _ in range(3)]
    for s, f in zip(runs["standard"], runs["fast"]):
        assert s.tokens == f.tokens
        assert math.isclose(s.loss, f.loss, rel_tol=2e-2), (s.loss, f.loss)
        assert math.isclose(s.grad_norm, f.grad_norm, rel_tol=1e-1), (s.grad_norm, f.grad_norm)
        assert abs(float(s.metrics["accuracy"]) - float(f.metrics["accuracy"])) < 0.05
        assert not f.skipped


def test_cuda_graphs_capture_and_replay(tmp_path):
    """A captured chunk replays the eager forward on new inputs of the same shape."""
    cfg = cuda_config(tmp_path, "graphs", step_path="fast", compile=False)
    tr = Trainer(cfg, log_to_console=False)
    assert tr.fast is not None and tr.fast.runner.graphs
    shapes = tr.fast.shapes
    graphed = tr.fast.runner
    eager = TargetRunner(tr.target, shapes, need_final=True, graphs=False)
    g = torch.Generator().manual_seed(0)
    lengths = [80, 60, 50, 40]  # one pack: they must fit its ctx_len
    assert sum(lengths) <= shapes.ctx_len
    for _ in range(3):
        ids = [torch.randint(0, 60, (n,), generator=g) for n in lengths]
        starts = torch.cumsum(torch.tensor([0, *lengths]), 0).tolist()
        # The same row shape every trial: one graph, replayed with new inputs.
        rows = layout_rows(lengths, shapes)
        chunks = build_chunks(rows, ids, starts, shapes)
        graphed.run(chunks)
        eager.run(chunks)
        n = sum(lengths)
        # The graph replays the eager kernels (cuBLAS may pick others under capture).
        torch.testing.assert_close(graphed.feat[:n], eager.feat[:n])
        assert graphed.final is not None and eager.final is not None
        torch.testing.assert_close(graphed.final[:n], eager.final[:n])
    assert graphed.capture_failed is None
    assert len(graphed.static) == 1
    assert all(replay.graph is not None for _, replay in graphed.static.values())


def test_cuda_fast_step_never_waits_on_the_gpu(tmp_path):
    """Target, drafter and optimizer stages queue their work without a host sync."""
    cfg = cuda_config(tmp_path, "nosync", step_path="fast", compile=True)
    tr = Trainer(cfg, log_to_console=False)
    fast = tr.fast
    assert fast is not None
    hs = fast.host_step(0, tr.position)
    # Warm-up: compile, autotune, capture (these may synchronise).
    tout = fast.target_stage(hs)
    res = fast.drafter_stage(hs, tout, 1.0)
    fast.optimizer_stage(res.loss.detach())
    torch.cuda.synchronize()
    tr.optimizer.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        tout = fast.target_stage(hs)
        res = fast.drafter_stage(hs, tout, 1.0)
        _, finite = fast.optimizer_stage(res.loss.detach())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(finite)


def _rows_close(got: torch.Tensor, want: torch.Tensor, lengths: list[int], tol: float = 3e-2):
    """Each row within `tol` of the reference, relative to the row's norm. Element-wise bounds
    fail on bf16 rounding alone (an element near zero in a row of norm ~10 is off by a whole
    bf16 step of its neighbours); a wrong mask moves whole rows by tens of percent."""
    err = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-6)
    bad = (err > tol).nonzero().flatten().tolist()
    ends = torch.tensor(lengths).cumsum(0).tolist()
    where = [
        (r, next(i for i, e in enumerate(ends) if r < e), round(float(err[r]), 3)) for r in bad
    ]
    assert not bad, f"rows off by more than {tol:.0%} (row, document, error): {where[:20]}"


def test_cuda_flex_target_in_graphs_matches_the_dense_target(tmp_path):
    """training.target_attention=flex: the whole pack as one sequence, its block mask and
    compiled FlexAttention captured in one graph, give the dense rows' features in bf16; and
    the fast step with it trains like the dense one."""
    wide = write_tiny_target(tmp_path / "target_head16", hidden_size=64)
    cfg = cuda_config(tmp_path, "flex", wide, step_path="fast", compile=True)
    tr = Trainer(cfg, log_to_console=False)
    assert tr.fast is not None
    shapes = tr.fast.shapes
    flex = TargetRunner(tr.target, shapes, need_final=True, graphs=True, flex=True)
    dense = TargetRunner(tr.target, shapes, need_final=True, graphs=False)
    g = torch.Generator().manual_seed(0)
    lengths = [80, 60, 50, 40]
    for _ in range(3):
        ids = [torch.randint(0, 60, (n,), generator=g) for n in lengths]
        pack = pack_documents(
            ids, [torch.ones(n, dtype=torch.bool) for n in lengths], pad_to=shapes.ctx_len
        )
        starts = pack.doc_starts_D.tolist()
        flex.run([pack_chunk(pack)])
        dense.run(build_chunks(layout_rows(lengths, shapes), ids, starts, shapes))
        n = sum(lengths)
        assert flex.final is not None and dense.final is not None
        _rows_close(flex.feat[:n], dense.feat[:n], lengths)
        _rows_close(flex.final[:n], dense.final[:n], lengths)
    assert flex.capture_failed is None, flex.capture_failed
    assert len(flex.static) == 1 and all(r.graph is not None for _, r in flex.static.values())
    assert tr.target.model.config._attn_implementation == "sdpa"
    runs = {}
    for attention in ("dense", "flex"):
        cfg = cuda_config(tmp_path, attention, wide, step_path="fast", target_attention=attention)
        t = Trainer(cfg, log_to_console=False)
        runs[attention] = [t.train_step() for _ in range(3)]
    for d, f in zip(runs["dense"], runs["flex"]):
        assert d.tokens == f.tokens
        assert math.isclose(d.loss, f.loss, rel_tol=2e-2), (d.loss, f.loss)


@pytest.mark.parametrize("codebooks", ["tables", "embedding"])
def test_cuda_dflash2_compiled_fast_step_matches_standard_and_never_waits(tmp_path, codebooks):
    """DFlash2 (convolutions inside the compiled layers, the selector's term in the loss) on
    the fast step: the standard step's numbers in bf16, and no host sync inside a step; with
    the selector's codebooks as tables and through the target embedding alike."""
    d2 = {"head_dim": 16, "kind": "dflash2", "conv_group_size": 8, "selector_rank": 8,
          "selector_top_k": 4, "selector_codebooks": codebooks}  # fmt: skip
    runs = {}
    for path in ("standard", "fast"):
        cfg = tiny_config(
            tmp_path,
            target={"dtype": "bfloat16"},
            drafter=d2,
            training={"device": "cuda", "precision": "bf16", "step_path": path, "compile": True},
            run={"output_dir": str(tmp_path / f"d2-{path}")},
        )
        tr = Trainer(cfg, log_to_console=False)
        runs[path] = (tr, [tr.train_step() for _ in range(3)])
    for s, f in zip(runs["standard"][1], runs["fast"][1]):
        assert math.isclose(s.loss, f.loss, rel_tol=2e-2), (s.loss, f.loss)
        assert abs(float(s.metrics["selector_tau"]) - float(f.metrics["selector_tau"])) < 0.2
    fast = runs["fast"][0].fast
    assert fast is not None
    tr = runs["fast"][0]
    hs = fast.host_step(10, tr.position)
    tout = fast.target_stage(hs)
    torch.cuda.synchronize()
    tr.optimizer.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = fast.drafter_stage(hs, tout, 1.0)
        _, finite = fast.optimizer_stage(res.loss.detach())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(finite)
