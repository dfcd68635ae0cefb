"""The drafter model: train/inference parity, packing equivalence, noise, state dict."""

from __future__ import annotations

import pytest
import torch
from conftest import make_spec, random_docs

from dflash_trainer.core.anchors import Anchors, block_input_ids, block_position_ids, sample_anchors
from dflash_trainer.core.drafter import DFlashDrafter, sdpa_attention
from dflash_trainer.core.masks import build_intervals, intervals_to_dense
from dflash_trainer.core.packing import pack_documents


def train_forward(model, pack, anchors, feats, emb_table):
    spec = model.spec
    ids = block_input_ids(anchors, pack.input_ids_T, spec.mask_token_id)
    emb = emb_table[ids.reshape(-1)]
    masks = {
        "full_attention": intervals_to_dense(build_intervals(anchors, pack.length, None)),
        "sliding_attention": intervals_to_dense(
            build_intervals(anchors, pack.length, spec.sliding_window)
        ),
    }
    pos = block_position_ids(anchors).reshape(-1)
    out = model(feats, pack.position_ids_T, emb, pos, masks, sdpa_attention)
    return out.view(anchors.num_anchors, anchors.block_size, -1)


CONFIGS = [
    dict(layers=1, block=4),
    dict(layers=2, block=8, layer_types=("sliding_attention", "full_attention"), window=3),
    dict(
        layers=3,
        block=4,
        heads=6,
        kv_heads=3,
        head_dim=8,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        window=6,
    ),
    dict(
        layers=2,
        block=16,
        heads=2,
        kv_heads=1,
        head_dim=32,
        layer_types=("full_attention", "sliding_attention"),
        window=20,
    ),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_training_forward_equals_inference_step(cfg):
    torch.manual_seed(0)
    spec = make_spec(**cfg)
    model = DFlashDrafter(spec, noise_std=0.05).double().eval()
    lengths = [23, 41, 30]
    ids, masks = random_docs(lengths, vocab=spec.vocab_size - 1)
    pack = pack_documents(ids, masks)
    anchors = sample_anchors(pack, 24, spec.block_size, torch.Generator().manual_seed(1))
    feats = torch.randn(pack.length, spec.num_context_features, dtype=torch.float64)
    emb_table = torch.randn(spec.vocab_size, spec.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        train = train_forward(model, pack, anchors, feats, emb_table)
        for n in range(anchors.num_real):
            a = int(anchors.anchor_idx_N[n])
            start = int(anchors.doc_start_N[n])
            pos_a = a - start
            cache = model.new_cache()
            # Extend in two pieces, as the speculative loop does after each accepted block.
            cut = pos_a // 2
            model.extend_cache(cache, feats[start : start + cut], torch.arange(cut))
            model.extend_cache(cache, feats[start + cut : a], torch.arange(cut, pos_a))
            blk = block_input_ids(anchors, pack.input_ids_T, spec.mask_token_id)[n]
            step = model.step(cache, emb_table[blk], pos_a)
            torch.testing.assert_close(step, train[n], atol=1e-10, rtol=1e-9)


def test_step_rejects_a_cache_of_the_wrong_length():
    spec = make_spec()
    model = DFlashDrafter(spec)
    cache = model.new_cache()
    model.extend_cache(cache, torch.randn(5, spec.num_context_features), torch.arange(5))
    with pytest.raises(ValueError, match="cache holds 5 positions"):
        model.step(cache, torch.randn(spec.block_size, spec.hidden_size), 7)
    cache.crop(3)
    assert cache.length == 3


def test_packed_forward_equals_per_document_forward():
    """Packing many documents into one forward changes nothing per document."""
    torch.manual_seed(0)
    spec = make_spec(
        layers=2, block=4, layer_types=("sliding_attention", "full_attention"), window=5
    )
    model = DFlashDrafter(spec).double().eval()
    lengths = [30, 17, 44, 9]
    ids, masks = random_docs(lengths, vocab=spec.vocab_size - 1)
    pack = pack_documents(ids, masks)
    anchors = sample_anchors(pack, 40, spec.block_size, torch.Generator().manual_seed(3))
    feats = torch.randn(pack.length, spec.num_context_features, dtype=torch.float64)
    emb_table = torch.randn(spec.vocab_size, spec.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        packed = train_forward(model, pack, anchors, feats, emb_table)
        for d, n_tok in enumerate(lengths):
            start = int(pack.doc_starts_D[d])
            rows = (anchors.doc_start_N == start).nonzero().flatten()
            rows = rows[rows < anchors.num_real]
            if rows.numel() == 0:
                continue
            single = pack_documents([ids[d]], [masks[d]])
            sub = Anchors(
                anchor_idx_N=anchors.anchor_idx_N[rows] - start,
                anchor_pos_N=anchors.anchor_pos_N[rows],
                doc_start_N=torch.zeros_like(rows),
                doc_end_N=torch.full_like(rows, n_tok),
                slot_valid_NB=anchors.slot_valid_NB[rows],
                slot_idx_NB=anchors.slot_idx_NB[rows] - start,
                num_real=int(rows.numel()),
            )
            alone = train_forward(model, single, sub, feats[start : start + n_tok], emb_table)
            torch.testing.assert_close(alone, packed[rows], atol=1e-10, rtol=1e-9)


def test_positions_restart_per_document():
    """A running position over the pack would give later documents other RoPE phases."""
    torch.manual_seed(0)
    spec = make_spec(layers=1, block=4)
    model = DFlashDrafter(spec).double().eval()
    ids, masks = random_docs([25, 25], vocab=spec.vocab_size - 1)
    ids[1] = ids[0].clone()
    masks[1] = masks[0].clone()
    pack = pack_documents(ids, masks)
    assert pack.position_ids_T[25].item() == 0
    assert torch.equal(pack.position_ids_T[:25], pack.position_ids_T[25:50])
    feats = torch.randn(25, spec.num_context_features, dtype=torch.float64).repeat(2, 1)
    emb_table = torch.randn(spec.vocab_size, spec.hidden_size, dtype=torch.float64)
    anchors = sample_anchors(pack, 100, spec.block_size, torch.Generator().manual_seed(0))
    out = train_forward(model, pack, anchors, feats, emb_table)
    first = {int(a): n for n, a in enumerate(anchors.anchor_idx_N) if a < 25}
    for n, a in enumerate(anchors.anchor_idx_N.tolist()):
        if a >= 25 and (a - 25) in first:
            torch.testing.assert_close(out[n], out[first[a - 25]])


def test_noise_only_in_training_and_never_on_the_callers_features():
    """U(-s, s) noise on the drafter's context input in train mode only."""
    torch.manual_seed(0)
    spec = make_spec(layers=1)
    model = DFlashDrafter(spec, noise_std=0.05)
    feats = torch.randn(10, spec.num_context_features)
    before = feats.clone()
    model.train()
    a, b = model.project_context(feats), model.project_context(feats)
    assert not torch.allclose(a, b)
    assert torch.equal(feats, before)
    # The noise is bounded by s: the projection of (feats + noise) stays close.
    model.eval()
    c, d = model.project_context(feats), model.project_context(feats)
    assert torch.equal(c, d)
    clean = DFlashDrafter(spec, noise_std=0.0).train()
    clean.load_state_dict(model.state_dict())
    torch.testing.assert_close(clean.project_context(feats), c)
    # Magnitude: the injected perturbation is uniform in [-s, s].
    torch.manual_seed(1)
    noise = model.train().fc.weight.new_zeros(())
    x = torch.zeros(1000, spec.num_context_features)
    model.fc.weight.data.copy_(torch.eye(spec.hidden_size, spec.num_context_features))
    model.hidden_norm.eps = 1e30  # turn the norm into a fixed scale to read the noise back
    scale = (1e30) ** 0.5
    got = model.project_context(x) * scale
    noise = got[:, : spec.hidden_size]
    assert noise.abs().max() <= 0.05 + 1e-6
    assert noise.abs().max() > 0.04
    assert abs(noise.mean().item()) < 0.01


def test_state_dict_has_only_drafter_weights():
    spec = make_spec(layers=2)
    names = set(DFlashDrafter(spec).state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    expected_layer = {
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    }
    want = {f"layers.{i}.{n}" for i in range(2) for n in expected_layer}
    want |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert names == want
