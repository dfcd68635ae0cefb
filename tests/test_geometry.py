"""Drafter geometry: derived from the target for shared dims, never copied for attention."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig

from dflash_trainer.config import ConfigError, DrafterConfig, TargetConfig, load_config
from dflash_trainer.core.drafter import DFlashDrafter, count_parameters
from dflash_trainer.core.geometry import default_target_layer_ids, resolve_drafter_spec
from dflash_trainer.target.configs import load_target_config


def test_default_target_layer_ids_match_published_drafters():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)  # Qwen3.6-27B
    assert default_target_layer_ids(30, 1) == (15,)


def test_qwen36_drafter_geometry_is_independent_of_the_target():
    """The drafter must not inherit the target's 24/4/256 attention (a bigger, slower drafter
    that the published weights cannot load into)."""
    cfg = load_config(recipe="qwen3.6-27b")
    target = load_target_config(cfg.target)
    spec = resolve_drafter_spec(cfg.drafter, target)
    assert (target.num_attention_heads, target.num_key_value_heads, target.head_dim) == (24, 4, 256)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (32, 8, 128)
    assert (spec.hidden_size, spec.vocab_size, spec.intermediate_size) == (5120, 248320, 17408)
    assert spec.layer_types == ("sliding_attention",) * 4 + ("full_attention",)
    assert spec.rope_theta == 1e7 and spec.sliding_window == 2048
    assert spec.target_layer_ids == (1, 16, 31, 46, 61)
    # Count parameters on the meta device (no memory): about 1.7B, not the copied 1.81B.
    import torch

    with torch.device("meta"):
        n = count_parameters(DFlashDrafter(spec))
    assert 1.65e9 < n < 1.75e9
    copied = resolve_drafter_spec(
        DrafterConfig(
            **{
                **cfg.drafter.__dict__,
                "num_attention_heads": 24,
                "num_key_value_heads": 4,
                "head_dim": 256,
            }
        ),
        target,
    )
    with torch.device("meta"):
        n_copied = count_parameters(DFlashDrafter(copied))
    assert 1.78e9 < n_copied < 1.84e9


def test_llama_class_drafter_with_24_heads_on_hidden_5120_is_rejected():
    target = load_target_config(TargetConfig(name_or_path="Qwen/Qwen3.6-27B"))
    dcfg = DrafterConfig(
        mask_token_id=248070,
        layer_class="llama",
        num_attention_heads=24,
        num_key_value_heads=4,
        geometry=None,
    )
    with pytest.raises(
        ConfigError, match=r"num_attention_heads=24 does not divide target hidden_size=5120"
    ):
        resolve_drafter_spec(dcfg, target)


def test_shared_dims_come_from_the_target():
    t = AutoConfig.for_model(
        "llama",
        hidden_size=96,
        vocab_size=333,
        num_hidden_layers=6,
        num_attention_heads=3,
        num_key_value_heads=1,
        intermediate_size=200,
    )
    spec = resolve_drafter_spec(DrafterConfig(num_layers=1, mask_token_id=5, geometry="small"), t)
    assert (spec.hidden_size, spec.vocab_size, spec.target_hidden_size) == (96, 333, 96)
    assert spec.intermediate_size == 200 and spec.num_attention_heads == 8
    assert spec.num_context_features == 5 * 96


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target_layer_ids": (1, 6)}, r"\[6\] out of range for a target with 6 layers"),
        ({"mask_token_id": None}, r"drafter\.mask_token_id: required"),
        ({"mask_token_id": 333}, r"outside the target vocab"),
        ({"geometry": None}, r"not set and no drafter\.geometry preset"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, r"not a multiple of"),
    ],
)
def test_geometry_errors(changes, message):
    t = AutoConfig.for_model(
        "llama",
        hidden_size=96,
        vocab_size=333,
        num_hidden_layers=6,
        num_attention_heads=3,
        num_key_value_heads=1,
    )
    base = {"num_layers": 1, "mask_token_id": 5, "geometry": "small"}
    with pytest.raises(ConfigError, match=message):
        resolve_drafter_spec(DrafterConfig(**{**base, **changes}), t)


@pytest.mark.parametrize(
    ("changes", "fails"),
    [
        ({}, None),
        ({"num_attention_heads": 16}, None),
        (
            {"geometry": None, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 96},
            None,
        ),
        ({"layer_class": "llama"}, None),
        (
            {"layer_class": "llama", "num_attention_heads": 24, "num_key_value_heads": 8},
            "geometry.divisibility",
        ),
        ({"layer_class": "llama", "head_dim": 96}, "geometry.divisibility"),
        ({"num_key_value_heads": 6}, "geometry.gqa"),
        ({"head_dim": 63}, "geometry.head_dim"),
        ({"geometry": None}, "geometry.chosen"),
    ],
)
def test_the_doctor_reports_the_geometry_training_builds(changes, fails):
    """One rule: the doctor shows the heads / head dim resolve_drafter_spec builds, and fails
    where it raises, with the message of the rule it raises for."""
    from dflash_trainer.core.geometry import attention_geometry
    from dflash_trainer.doctor.geometry_checks import check_geometry

    cfg = load_config(recipe="qwen3.6-27b")
    cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, **changes))
    target = load_target_config(cfg.target)
    checks = {c.id: c for c in check_geometry(cfg, target)}
    failed = [i for i, c in checks.items() if c.status == "fail"]
    if fails is not None:
        assert failed == [fails]
        first = next(iter(attention_geometry(cfg.drafter, target.hidden_size).broken.values()))
        with pytest.raises(ConfigError) as raised:
            resolve_drafter_spec(cfg.drafter, target)
        assert str(raised.value) == first
        return
    assert failed == []
    spec = resolve_drafter_spec(cfg.drafter, target)
    shown = checks["geometry.divisibility"].message
    assert f"{spec.num_attention_heads} heads x head_dim {spec.head_dim}" in shown
    assert checks["geometry.gqa"].message.startswith(
        f"{spec.num_attention_heads // spec.num_key_value_heads} query heads"
    )
