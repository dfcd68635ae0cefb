"""The attention rule: intervals, block-sparse BlockMask and FlexAttention vs the dense reference."""

from __future__ import annotations

import pytest
import torch
from conftest import make_spec, random_docs
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trainer.core.anchors import block_position_ids, sample_anchors
from dflash_trainer.core.drafter import DFlashDrafter, flex_attention_eager, sdpa_attention
from dflash_trainer.core.masks import (
    FLEX_BLOCK,
    build_block_mask,
    build_intervals,
    dense_reference,
    inference_mask,
    intervals_to_dense,
)
from dflash_trainer.core.packing import pack_documents

LAYOUTS = [[50, 37, 90], [300], [5, 5, 5, 200, 17], [129, 127, 1, 2]]


def _setup(lengths, block=4, max_anchors=64, seed=0):
    ids, masks = random_docs(lengths, seed=seed)
    pack = pack_documents(ids, masks, pad_multiple=FLEX_BLOCK)
    pad_to = -(-max_anchors * block // FLEX_BLOCK) * FLEX_BLOCK // block
    anchors = sample_anchors(pack, max_anchors, block, torch.Generator().manual_seed(seed), pad_to)
    return pack, anchors


def block_mask_to_dense(bm, q_len, kv_len, block=FLEX_BLOCK):
    """Element-level view of a BlockMask: full blocks True, partial blocks via mask_mod."""
    out = torch.zeros(q_len, kv_len, dtype=torch.bool)
    kv_num, kv_idx = bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0]
    f_num, f_idx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    for qb in range(q_len // block):
        qs = torch.arange(qb * block, (qb + 1) * block)
        for j in f_idx[qb, : f_num[qb]].tolist():
            out[qs[:, None], torch.arange(j * block, (j + 1) * block)[None, :]] = True
        for j in kv_idx[qb, : kv_num[qb]].tolist():
            kvs = torch.arange(j * block, (j + 1) * block)
            qq, kk = torch.meshgrid(qs, kvs, indexing="ij")
            zero = torch.zeros_like(qq)
            out[qq, kk] = bm.mask_mod(zero, zero, qq, kk)
    return out


@pytest.mark.parametrize("lengths", LAYOUTS)
@pytest.mark.parametrize("window", [None, 2, 3, 7, 40])
def test_intervals_and_block_mask_equal_dense_reference(lengths, window):
    pack, anchors = _setup(lengths)
    ref = dense_reference(pack, anchors, pack.length, window)
    iv = build_intervals(anchors, pack.length, window)
    assert torch.equal(intervals_to_dense(iv), ref)
    bm = build_block_mask(iv)
    assert torch.equal(block_mask_to_dense(bm, iv.q_len, iv.kv_len), ref)


def test_block_mask_skips_exactly_the_invisible_blocks():
    # Many documents: a query block must list exactly the key blocks it can see,
    # so compute skips everything else (and full blocks need no mask_mod).
    pack, anchors = _setup([100] * 12, max_anchors=128)
    iv = build_intervals(anchors, pack.length, None)
    bm = build_block_mask(iv)
    ref = dense_reference(pack, anchors, pack.length, None)
    nq, nkv = iv.q_len // FLEX_BLOCK, iv.kv_len // FLEX_BLOCK
    blocks = ref.view(nq, FLEX_BLOCK, nkv, FLEX_BLOCK)
    touched = blocks.any(3).any(1)
    assert torch.equal(bm.kv_num_blocks[0, 0] + bm.full_kv_num_blocks[0, 0], touched.sum(1).int())
    assert torch.equal(bm.full_kv_num_blocks[0, 0], blocks.all(3).all(1).sum(1).int())
    assert touched.sum() < 0.5 * nq * nkv


def test_rule_never_crosses_documents_or_blocks():
    pack, anchors = _setup([40, 40, 40], block=8)
    ref = dense_reference(pack, anchors, pack.length, None)
    b = anchors.block_size
    for n in range(anchors.num_real):
        a = anchors.anchor_idx_N[n]
        doc = pack.document_ids_T[a]
        rows = ref[n * b : (n + 1) * b]
        ctx = rows[:, : pack.length]
        seen = ctx.any(0).nonzero().flatten()
        assert (pack.document_ids_T[seen] == doc).all()
        assert (seen < a).all()  # strictly before the anchor: its own feature is unknown
        blk = rows[:, pack.length :]
        own = torch.zeros_like(blk)
        own[:, n * b : (n + 1) * b] = True
        assert not (blk & ~own).any()


def test_inference_mask_matches_training_rule():
    # One document, anchor at 10: the training rule's row for that block equals the step mask.
    ids, masks = random_docs([30])
    masks[0][:] = True
    pack = pack_documents(ids, masks)
    from dflash_trainer.core.anchors import Anchors

    b = 4
    k = torch.arange(b)
    anchors = Anchors(
        anchor_idx_N=torch.tensor([10]),
        anchor_pos_N=torch.tensor([10]),
        doc_start_N=torch.tensor([0]),
        doc_end_N=torch.tensor([30]),
        slot_valid_NB=k[None] >= 1,
        slot_idx_NB=10 + k[None],
        num_real=1,
    )
    for w in (None, 2, 5):
        ref = dense_reference(pack, anchors, pack.length, w)
        step = inference_mask(10, b, w, "cpu")
        assert torch.equal(ref[:, :10], step[:, :10])
        assert not ref[:, 10 : pack.length].any()
        assert torch.equal(ref[:, pack.length :], step[:, 10:])


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    block=st.sampled_from([2, 4, 8, 16]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    seed=st.integers(0, 10_000),
)
def test_block_mask_property(lengths, block, window, seed):
    ids, masks = random_docs(lengths, seed=seed)
    pack = pack_documents(ids, masks, pad_multiple=FLEX_BLOCK)
    pad_to = FLEX_BLOCK // block * 2
    anchors = sample_anchors(pack, pad_to, block, torch.Generator().manual_seed(seed), pad_to)
    ref = dense_reference(pack, anchors, pack.length, window)
    iv = build_intervals(anchors, pack.length, window)
    assert torch.equal(intervals_to_dense(iv), ref)
    assert torch.equal(block_mask_to_dense(build_block_mask(iv), iv.q_len, iv.kv_len), ref)


def _flex_vs_dense(device, lengths, requires_grad):
    spec = make_spec(layers=2, layer_types=("sliding_attention", "full_attention"), window=5)
    torch.manual_seed(0)
    model = DFlashDrafter(spec).to(device)
    pack, anchors = _setup(lengths)
    pack, anchors = pack.to(device), anchors.to(device)
    feats = torch.randn(pack.length, spec.num_context_features, device=device)
    emb = torch.randn(anchors.num_anchors * anchors.block_size, spec.hidden_size, device=device)
    pos = block_position_ids(anchors).reshape(-1)
    ivs = {
        "full_attention": build_intervals(anchors, pack.length, None),
        "sliding_attention": build_intervals(anchors, pack.length, spec.sliding_window),
    }
    dense = {k: intervals_to_dense(v) for k, v in ivs.items()}
    flex = {k: build_block_mask(v) for k, v in ivs.items()}
    model.requires_grad_(requires_grad)
    out_ref = model(feats, pack.position_ids_T, emb, pos, dense, sdpa_attention)
    grads_ref = None
    if requires_grad:
        out_ref.square().sum().backward()
        grads_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
    attn = torch.compile(flex_attention_eager) if device != "cpu" else flex_attention_eager
    out = model(feats, pack.position_ids_T, emb, pos, flex, attn)
    real = anchors.real_N.repeat_interleave(anchors.block_size)
    torch.testing.assert_close(out[real], out_ref[real], atol=2e-5, rtol=2e-5)
    if requires_grad:
        out.square().sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads_ref[n], atol=1e-4, rtol=1e-3, msg=n)


@pytest.mark.parametrize("lengths", LAYOUTS)
def test_flex_forward_equals_dense_on_cpu(lengths):
    # FlexAttention has no CPU backward; gradients are checked on GPU below, and the
    # element-level mask equality above is what makes them equal by construction.
    _flex_vs_dense("cpu", lengths, requires_grad=False)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_compiled_flex_forward_and_grads_equal_dense_on_gpu(lengths):
    torch.backends.cuda.matmul.allow_tf32 = False
    _flex_vs_dense("cuda", lengths, requires_grad=True)
