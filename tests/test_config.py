"""Config: recipes load, overrides apply, mistakes name the field and the fix."""

from __future__ import annotations

import pytest

from dflash_trainer.config import (
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    load_config,
    recipe_names,
)


def test_all_recipes_load_and_round_trip():
    names = recipe_names()
    assert {"smollm2-135m-demo", "smollm2-135m", "qwen3-8b", "qwen3.6-27b"} <= set(names)
    for name in names:
        cfg = load_config(recipe=name)
        assert isinstance(cfg, Config)
        assert config_from_dict(config_to_dict(cfg)) == cfg


def test_dotted_overrides_parse_yaml_values():
    cfg = load_config(
        recipe="qwen3-8b",
        overrides=["training.lr=3e-4", "drafter.target_layer_ids=[2, 4]", "training.compile=false"],
    )
    assert cfg.training.lr == 3e-4
    assert cfg.drafter.target_layer_ids == (2, 4)
    assert cfg.training.compile is False


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.lrr=1", r"training\.lrr: unknown key; valid keys of training are"),
        ("training.lr=fast", r"training\.lr: expected a number, got 'fast'"),
        ("training.lr=-1", r"training\.lr: must be in \(0, 1\], got -1\.0"),
        ("training.loss=mse", r"training\.loss: must be one of \['ce', 'kl'\]"),
        ("drafter.block_size=1", r"drafter\.block_size: must be in \[2, 256\]"),
        ("trainig.lr=1", r"must start with a section"),
        ("training.lr", r"expected section\.field=value"),
        (
            "drafter.layer_types=[full_attention]",
            r"drafter\.layer_types: has 1 entries but drafter\.num_layers is 5",
        ),
        ("drafter.target_layer_ids=[3, 3]", r"drafter\.target_layer_ids: has duplicates"),
        ("training.max_anchors=true", r"training\.max_anchors: expected an integer"),
    ],
)
def test_mistakes_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(recipe="qwen3-8b", overrides=[override])


def test_sliding_layers_need_a_window():
    with pytest.raises(ConfigError, match=r"drafter\.sliding_window"):
        config_from_dict(
            {"drafter": {"num_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}}
        )


def test_inconsistent_loss_settings():
    with pytest.raises(ConfigError, match="dpace"):
        config_from_dict({"training": {"loss": "kl", "weighting": "dpace"}})
    with pytest.raises(ConfigError, match="kl needs the target"):
        config_from_dict({"training": {"loss": "kl", "labels": "data"}})


def test_unknown_recipe_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown recipe 'nope'; available recipes"):
        load_config(recipe="nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(config_file=str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(config_file=str(bad))


def test_gamma_defaults_follow_the_paper():
    t = load_config().training
    assert (t.resolved_gamma(16), t.resolved_gamma(10), t.resolved_gamma(8)) == (7.0, 5.0, 4.0)
