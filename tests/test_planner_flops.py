"""The planner's FLOP and parameter counts against torch's FlopCounterMode on real forwards.

FlopCounterMode does not count the CPU flash-attention kernel, so attention runs on
SDPA's math backend here: it computes every query-key pair, which is the planner's
`dense` attention count (the block-sparse counts are checked against the mask).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_spec, random_docs
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dflash_trainer.core.drafter import DFlashDrafter, count_parameters, sdpa_attention
from dflash_trainer.core.masks import build_intervals, dense_reference, intervals_to_dense
from dflash_trainer.core.packing import pack_documents
from dflash_trainer.plan.flops import (
    describe_target,
    drafter_backward_flops,
    drafter_forward_flops,
    drafter_params,
    loss_flops,
    selector_flops,
    target_forward_flops,
)
from dflash_trainer.plan.workload import AttentionPairs, StepShape, count_pairs, synthetic_pack
from dflash_trainer.target.configs import KNOWN_CONFIGS, config_from_dict
from dflash_trainer.train.step import StepSettings, TargetOut, drafter_loss, prepare_blocks

SPECS = [
    dict(
        layers=2,
        block=4,
        heads=4,
        kv_heads=2,
        head_dim=16,
        layer_types=("sliding_attention", "full_attention"),
        window=5,
    ),
    dict(layers=3, block=8, heads=6, kv_heads=3, head_dim=8, hidden=96, vocab=211, n_tapped=2),
    dict(layers=2, block=4, heads=4, kv_heads=2, head_dim=16, kind="dflash2", conv_group_size=8,
         selector_rank=12, selector_top_k=5),
]  # fmt: skip


def _settings(spec, loss: str) -> StepSettings:
    return StepSettings(
        block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        max_anchors=12,
        labels="target" if loss == "kl" else "data",
        loss=loss,
        weighting="decay",
        gamma=4.0,
        dpace_alpha=0.5,
        chunk_rows=7,
        top_k=spec.selector_top_k if spec.is_dflash2 else 0,
    )


def _shape_of(blocks, spec) -> StepShape:
    t, q = blocks.pack.length, blocks.anchors.num_anchors * spec.block_size
    dense = AttentionPairs(dense=q * (t + q), visible=0.0, tiles=0.0)
    return StepShape(
        docs=blocks.pack.num_docs,
        target_tokens=t,
        target_padded_tokens=t,
        target_max_len=t,
        target_micro_batches=1,
        target_attn_pairs=0,
        ctx_len=t,
        anchors=blocks.anchors.num_anchors,
        block_size=spec.block_size,
        rows=float(blocks.anchors.slot_valid_NB.sum()),
        pairs={kind: dense for kind in spec.layer_types},
    )


CASES = [(cfg, "tables") for cfg in SPECS] + [(SPECS[-1], "embedding")]


@pytest.mark.parametrize("loss", ["ce", "kl"])
@pytest.mark.parametrize(("cfg", "codebooks"), CASES)
def test_drafter_step_flops_match_flop_counter(cfg, codebooks, loss):
    torch.manual_seed(0)
    spec = make_spec(**cfg)
    model = DFlashDrafter(spec, noise_std=0.05, selector_codebooks=codebooks).train()
    ids, masks = random_docs([50, 70, 33], vocab=spec.vocab_size - 1, p_mask=0.7)
    pack = pack_documents(ids, masks)
    feats = torch.randn(pack.length, spec.num_context_features)
    final = torch.randn(pack.length, spec.hidden_size) if loss == "kl" else None
    emb = torch.nn.Embedding(spec.vocab_size, spec.hidden_size).requires_grad_(False)
    if model.candidate_selector is not None:
        model.candidate_selector.attach_embedding(emb.weight)
    st = _settings(spec, loss)
    blocks = prepare_blocks(
        TargetOut(pack, feats, final),
        None,
        st,
        torch.Generator().manual_seed(1),
        torch.device("cpu"),
    )
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        res = drafter_loss(model, blocks, emb, emb.weight.detach(), st, sdpa_attention)
        res.loss.backward()
    measured = counter.get_total_flops()
    shape = _shape_of(blocks, spec)
    predicted = (
        drafter_forward_flops(spec, shape, "dense").total()
        + drafter_backward_flops(spec, shape, "dense").total()
        + loss_flops(spec, shape.rows, loss).total()
        + selector_flops(spec, shape.queries, codebooks).total()
    )
    assert measured > 0
    assert predicted == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("cfg", SPECS)
def test_drafter_params_are_exact(cfg):
    spec = make_spec(**cfg)
    assert drafter_params(spec) == count_parameters(DFlashDrafter(spec))
    biased = dataclasses.replace(spec, attention_bias=True)
    assert drafter_params(biased) == count_parameters(DFlashDrafter(biased))
    d2 = dataclasses.replace(
        spec, kind="dflash2", conv_kernel_size=3, conv_group_size=8, selector_rank=6
    )
    assert drafter_params(d2) == count_parameters(DFlashDrafter(d2))
    # Embedding-mode codebooks train [H, r] factors instead of [V, r] tables.
    emb = DFlashDrafter(d2, selector_codebooks="embedding")
    assert drafter_params(d2, "embedding") == count_parameters(emb) < drafter_params(d2)


@pytest.mark.parametrize("window", [None, 3, 40])
def test_visible_pairs_equal_the_dense_reference_mask(window):
    spec = make_spec(block=8)
    st = dataclasses.replace(_settings(spec, "ce"), max_anchors=40)
    pack = synthetic_pack([150, 90, 17, 260], 0.6, pad_to=None)
    n, rows, pairs = count_pairs(pack, st, window, seed=3)
    from dflash_trainer.core.anchors import sample_anchors
    from dflash_trainer.plan.workload import FLEX_BLOCK

    anchors = sample_anchors(
        pack, 40, 8, torch.Generator().manual_seed(3), pad_to=None, pad_multiple=FLEX_BLOCK // 8
    )
    assert anchors.num_anchors == n
    ref = dense_reference(pack, anchors, pack.length, window)
    assert pairs.visible == float(ref.sum())
    assert pairs.visible == float(
        intervals_to_dense(build_intervals(anchors, pack.length, window)).sum()
    )
    assert pairs.visible <= pairs.tiles <= pairs.dense
    assert rows == float(anchors.slot_valid_NB.sum())


TINY_TARGETS = {
    "qwen3": (
        "Qwen/Qwen3-8B",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=300,
        ),
    ),
    "qwen3.6-hybrid": (
        "Qwen/Qwen3.6-27B",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=300,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(TINY_TARGETS))
def test_target_forward_flops_match_flop_counter(name):
    """A right-padded batch through a real HF target (full attention and Gated DeltaNet)."""
    from transformers import AutoModelForCausalLM

    from dflash_trainer.target.model import FrozenTarget

    hub_id, over = TINY_TARGETS[name]
    cfg = config_from_dict({**KNOWN_CONFIGS[hub_id], **over, "eos_token_id": 1, "bos_token_id": 1})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    target = FrozenTarget(model, [0, cfg.num_hidden_layers - 1])
    lengths = [70, 45, 64]
    docs = [torch.randint(0, 300, (n,)) for n in lengths]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        target.forward_documents(docs, need_final=True)
    tm = describe_target(cfg)
    longest = max(lengths)
    shape = StepShape(
        docs=len(docs),
        target_tokens=sum(lengths),
        target_padded_tokens=len(docs) * longest,
        target_max_len=longest,
        target_micro_batches=1,
        target_attn_pairs=len(docs) * longest**2,
        ctx_len=0,
        anchors=0,
        block_size=4,
        rows=0,
    )
    f = target_forward_flops(tm, shape, tm.num_layers, 0)
    # Triangular solves are real work but not a FlopCounterMode op.
    predicted = f.total() - f.by_name().get("linear_attention.solve", 0.0)
    assert predicted == pytest.approx(counter.get_total_flops(), rel=0.05)


def test_qwen36_target_layout():
    from dflash_trainer.config import TargetConfig
    from dflash_trainer.target.configs import load_target_config

    tm = describe_target(load_target_config(TargetConfig(name_or_path="Qwen/Qwen3.6-27B")))
    assert tm.kind_counts == {"linear_attention": 48, "full_attention": 16}
    assert tm.total_params == pytest.approx(26.9e9, rel=0.01)
    assert tm.lm_head_params == 248320 * 5120  # untied
