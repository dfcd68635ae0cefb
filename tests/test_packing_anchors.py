"""Packing and anchors: per-document positions, eligibility, labels never from another document."""

from __future__ import annotations

import pytest
import torch
from conftest import random_docs
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trainer.core.anchors import (
    block_input_ids,
    block_position_ids,
    data_labels,
    eligible_anchors,
    sample_anchors,
)
from dflash_trainer.core.packing import pack_documents

doc_lists = st.lists(
    st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=40),
    min_size=1,
    max_size=7,
)


def _pack(docs, pad_multiple=1):
    ids = [torch.tensor([t for t, _ in d]) for d in docs]
    masks = [torch.tensor([m for _, m in d]) for d in docs]
    return pack_documents(ids, masks, pad_multiple=pad_multiple), ids, masks


@settings(max_examples=60, deadline=None)
@given(docs=doc_lists, pad=st.sampled_from([1, 16, 128]))
def test_pack_structure(docs, pad):
    pack, ids, masks = _pack(docs, pad)
    assert pack.length % pad == 0 and pack.length >= pack.num_tokens
    for d, (x, m) in enumerate(zip(ids, masks)):
        s, n = int(pack.doc_starts_D[d]), int(pack.doc_lengths_D[d])
        assert n == len(x)
        assert torch.equal(pack.input_ids_T[s : s + n], x)
        assert torch.equal(pack.loss_mask_T[s : s + n], m)
        assert (pack.document_ids_T[s : s + n] == d).all()
        assert torch.equal(pack.position_ids_T[s : s + n], torch.arange(n))
    tail = slice(pack.num_tokens, pack.length)
    assert (pack.document_ids_T[tail] == -1).all() and not pack.loss_mask_T[tail].any()


@settings(max_examples=80, deadline=None)
@given(
    docs=doc_lists,
    block=st.sampled_from([2, 4, 16]),
    max_anchors=st.integers(1, 60),
    seed=st.integers(0, 1000),
)
def test_anchor_properties(docs, block, max_anchors, seed):
    pack, _, masks = _pack(docs)
    elig = eligible_anchors(pack)
    want = []
    for d, m in enumerate(masks):
        s = int(pack.doc_starts_D[d])
        want += [s + a for a in range(len(m) - 1) if m[a + 1]]
    assert elig.nonzero().flatten().tolist() == want

    an = sample_anchors(pack, max_anchors, block, torch.Generator().manual_seed(seed))
    assert an.num_real == min(max_anchors, len(want))
    picked = an.anchor_idx_N[: an.num_real].tolist()
    assert picked == sorted(set(picked)) and set(picked) <= set(want)
    for n, a in enumerate(picked):
        d = int(pack.document_ids_T[a])
        s, e = int(pack.doc_starts_D[d]), int(pack.doc_starts_D[d] + pack.doc_lengths_D[d])
        assert (int(an.doc_start_N[n]), int(an.doc_end_N[n])) == (s, e)
        assert an.anchor_pos_N[n] == a - s
        for k in range(block):
            valid = bool(an.slot_valid_NB[n, k])
            inside = a + k < e
            assert valid == (k >= 1 and inside and bool(pack.loss_mask_T[a + k]))
            # Every index used for labels / target logits stays in the document.
            assert s <= an.slot_idx_NB[n, k] < e
            assert s <= an.pred_idx_NB()[n, k] < e
            if valid:
                assert an.slot_idx_NB[n, k] == a + k and an.pred_idx_NB()[n, k] == a + k - 1
        assert an.slot_valid_NB[n, 1]  # eligibility guarantees one supervised slot


def test_anchor_near_document_end_takes_nothing_from_the_next_document():
    """The block of an anchor 2 tokens before its document's end: its labels, logits and
    features must not come from the start of the next document."""
    ids = [torch.arange(10), torch.arange(100, 110)]
    masks = [torch.ones(10, dtype=torch.bool), torch.ones(10, dtype=torch.bool)]
    pack = pack_documents(ids, masks)
    an = sample_anchors(pack, 100, 6, torch.Generator().manual_seed(0))
    n = an.anchor_idx_N.tolist().index(7)
    assert an.slot_valid_NB[n].tolist() == [False, True, True, False, False, False]
    labels = data_labels(an, pack.input_ids_T)[n]
    assert (labels < 100).all()  # nothing from document 2 (ids 100..109)
    assert (an.pred_idx_NB()[n] < 10).all()
    # The last token of a document is never an anchor (nothing to predict after it).
    assert 9 not in an.anchor_idx_N.tolist()


def test_sampling_is_uniform_over_the_pack():
    # Documents get anchors in proportion to their supervised tokens.
    ids, masks = random_docs([400, 100], p_mask=1.0)
    pack = pack_documents(ids, masks)
    counts = torch.zeros(2)
    for seed in range(200):
        an = sample_anchors(pack, 50, 4, torch.Generator().manual_seed(seed))
        counts += torch.bincount(pack.document_ids_T[an.anchor_idx_N], minlength=2)
    frac = counts[0] / counts.sum()
    assert abs(frac.item() - 399 / 498) < 0.02


def test_padded_anchors_are_inert():
    ids, masks = random_docs([20])
    pack = pack_documents(ids, masks)
    an = sample_anchors(pack, 5, 4, torch.Generator().manual_seed(0), pad_to=16)
    assert an.num_anchors == 16 and an.num_real == 5
    assert not an.slot_valid_NB[5:].any()
    assert an.real_N.tolist() == [True] * 5 + [False] * 11
    with pytest.raises(ValueError, match="do not fit"):
        sample_anchors(pack, 20, 4, torch.Generator().manual_seed(0), pad_to=3)


def test_block_inputs_and_positions():
    ids, masks = random_docs([12, 12], p_mask=1.0)
    pack = pack_documents(ids, masks)
    an = sample_anchors(pack, 100, 4, torch.Generator().manual_seed(0))
    blk = block_input_ids(an, pack.input_ids_T, mask_token_id=99)
    assert torch.equal(blk[:, 0], pack.input_ids_T[an.anchor_idx_N])
    assert (blk[:, 1:] == 99).all()
    pos = block_position_ids(an)
    assert torch.equal(pos[:, 0], an.anchor_pos_N)
    assert torch.equal(pos[:, 3] - pos[:, 0], torch.full_like(pos[:, 0], 3))


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        pack_documents([torch.tensor([], dtype=torch.long)], [torch.tensor([], dtype=torch.bool)])
    with pytest.raises(ValueError, match="loss mask shape"):
        pack_documents([torch.arange(3)], [torch.ones(2, dtype=torch.bool)])
