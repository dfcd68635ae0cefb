"""The frozen target: taps, right padding, batch isolation (attention-only and hybrid)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_trainer.target.model import FrozenTarget


def tiny_llama(vocab_size: int = 101) -> torch.nn.Module:
    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


def tiny_hybrid() -> torch.nn.Module:
    """A tiny qwen3_5 (Gated DeltaNet + gated full attention) built in code."""
    cfg = AutoConfig.for_model(
        "qwen3_5_text",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=101,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


@pytest.fixture(params=["llama", "qwen3_5"])
def target(request) -> FrozenTarget:
    model = tiny_llama() if request.param == "llama" else tiny_hybrid()
    return FrozenTarget(model, [0, 2])


def test_taps_equal_hf_hidden_states(target):
    ids = torch.randint(0, 100, (1, 20))
    out = target.model(ids, output_hidden_states=True)
    batch = target.forward_documents([ids[0]])
    want = torch.cat([out.hidden_states[1], out.hidden_states[3]], -1)[0]
    torch.testing.assert_close(batch.features_TF, want)
    logits = target.model.get_output_embeddings()(batch.final_hidden_TH)
    torch.testing.assert_close(logits, out.logits[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(
        target.argmax_at(batch.final_hidden_TH, chunk_rows=7), out.logits[0].argmax(-1)
    )


def test_document_features_do_not_depend_on_batch_mates(target):
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(0, 100, (17,), generator=g)
    others = [torch.randint(0, 100, (n,), generator=g) for n in (40, 5, 23)]
    alone = target.forward_documents([doc])
    mixed = target.forward_documents([others[0], doc, others[1], others[2]])
    start = 40
    torch.testing.assert_close(
        mixed.features_TF[start : start + 17], alone.features_TF, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        mixed.final_hidden_TH[start : start + 17], alone.final_hidden_TH, atol=1e-5, rtol=1e-5
    )
    assert mixed.features_TF.shape[0] == 40 + 17 + 5 + 23


def test_stop_after_last_tap_gives_the_same_features(target):
    docs = [torch.randint(0, 100, (n,)) for n in (9, 14)]
    full = target.forward_documents(docs, need_final=True)
    early = target.forward_documents(docs, need_final=False)
    assert early.final_hidden_TH is None
    torch.testing.assert_close(early.features_TF, full.features_TF)


def test_out_of_range_layer_ids_are_rejected():
    from dflash_trainer.errors import DFlashError

    with pytest.raises(DFlashError, match=r"\[4\] out of range for a 4-layer target"):
        FrozenTarget(tiny_llama(), [1, 4])
