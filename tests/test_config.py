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


def test_free_form_maps_are_bounded_at_load():
    for override, message in [
        ("target.hf_config_overrides={rms_norm_eps: .nan}", "rms_norm_eps: must be a finite"),
        ("run.storage_options={a: {b: {c: {d: {e: 1}}}}}", "nested more than 4 levels"),
        ("run.storage_options={a: " + "x" * 5000 + "}", "at most 4096"),
        ("run.storage_options={a: [" + ",".join(["1"] * 300) + "]}", "too many values"),
        ("run.storage_options={1: a}", "keys must be strings"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=[override])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.lrr=1", r"training\.lrr: unknown key; valid keys of training are"),
        ("training.lr=fast", r"training\.lr: expected a number, got 'fast'"),
        ("training.lr=-1", r"training\.lr: must be in \(0, 1\], got -1\.0"),
        ("training.loss=mse", r"training\.loss: must be one of \['ce', 'kl', 'lk'\]"),
        ("drafter.block_size=1", r"drafter\.block_size: must be in \[2, 256\]"),
        ("trainig.lr=1", r"must start with a section"),
        ("training.lr", r"expected section\.field=value"),
        (
            "drafter.layer_types=[full_attention]",
            r"drafter\.layer_types: has 1 entries but drafter\.num_layers is 5",
        ),
        ("drafter.target_layer_ids=[3, 3]", r"drafter\.target_layer_ids: has duplicates"),
        ("training.max_anchors=true", r"training\.max_anchors: expected an integer"),
        ("data.sources=[{}]", r"data\.sources\[0\]\.name: required key missing"),
        ("data.loop_tails=cut", r"data\.loop_tails: must be one of \['keep', 'mask'\]"),
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


# ---------------------------------------------------------------- one validation layer


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.lr=.nan", r"training\.lr: must be a finite number, got nan"),
        ("training.lr=.inf", r"training\.lr: must be a finite number, got inf"),
        ("drafter.rms_norm_eps=.nan", r"drafter\.rms_norm_eps: must be a finite number"),
        ("drafter.rope_theta=.nan", r"drafter\.rope_theta: must be a finite number"),
        ("training.gamma=-.inf", r"training\.gamma: must be a finite number"),
        ("training.betas=[0.9, 1.0]", r"training\.betas\[1\]: must be in \[0, 1\)"),
        ("training.betas=[-0.1, 0.9]", r"training\.betas\[0\]: must be in \[0, 1\)"),
        ("training.seed=-1", r"training\.seed: must be in \[0, 2\*\*63-1\]"),
        ("eval.seed=9223372036854775808", r"eval\.seed: must be in \[0, 2\*\*63-1\]"),
        ("data.shuffle_seed=-5", r"data\.shuffle_seed: must be in \[0, 2\*\*63-1\]"),
        ("drafter.max_position_embeddings=0", r"drafter\.max_position_embeddings: must be in \[1,"),
        ("eval.prompts=[]", r"eval\.prompts: must not be empty"),
        ("eval.prompts=['']", r"eval\.prompts\[0\]: must not be empty"),
        ("data.token_budget=50000000", r"data\.token_budget: must be in \[16, 2\*\*18\].*sanity"),
        ("data.max_doc_tokens=10000000", r"data\.max_doc_tokens: must be in \[2, 2\*\*18\]"),
        ("training.max_anchors=1000000", r"training\.max_anchors: must be in \[1, 16384\]"),
        ("drafter.num_layers=1000000", r"drafter\.num_layers: must be in \[1, 64\]"),
        (
            "run.checkpoint_dir=nosuchproto://bucket/run",
            r"run\.checkpoint_dir: unknown protocol 'nosuchproto'.*fsspec knows \[.*s3",
        ),
        (
            "run.output_dir=s3://bucket/run",
            r"run\.output_dir: must be a local directory, not a URL.*run\.checkpoint_dir",
        ),
        ("run.checkpoint_dir=zzz://x", r"run\.checkpoint_dir: unknown protocol 'zzz'"),
        ("target.gguf_file=../../x.gguf", r"target\.gguf_file: must be a file name"),
        (
            "target.hf_config_overrides={1: 2}",
            r"target\.hf_config_overrides: keys must be field names",
        ),
        ("training.device=cuda:x", r"training\.device"),
    ],
)
def test_every_field_passes_the_declared_rule(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(recipe="qwen3-8b", overrides=[override])


def test_rules_also_hold_for_configs_built_in_python():
    from dflash_trainer.config import DrafterConfig, TrainingConfig, replace

    with pytest.raises(ConfigError, match=r"training\.lr: must be a finite number"):
        TrainingConfig(lr=float("nan"))
    with pytest.raises(ConfigError, match=r"drafter\.num_layers: expected an integer"):
        DrafterConfig(num_layers="5")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"training\.betas\[0\]"):
        replace(load_config(), training={"betas": (1.5, 0.9)})
    assert TrainingConfig(betas=[0.8, 0.9]).betas == (0.8, 0.9)  # type: ignore[arg-type]


def test_known_protocol_passes_and_local_paths_are_untouched():
    cfg = load_config(overrides=["run.checkpoint_dir=memory://run", "data.train=asset:x"])
    assert cfg.run.checkpoint_dir == "memory://run"


def test_rejections_are_fast():
    import time

    t0 = time.perf_counter()
    for o in ("drafter.num_layers=1000000", "data.token_budget=50000000", "training.lr=.nan"):
        with pytest.raises(ConfigError):
            load_config(recipe="qwen3-8b", overrides=[o])
    assert time.perf_counter() - t0 < 1.0


def test_every_field_declares_a_rule_or_has_a_closed_type():
    """Numbers and strings carry a Rule; bools, Literals and dicts are closed by type."""
    import dataclasses
    import typing

    from dflash_trainer.config import Config

    missing = []
    for section in dataclasses.fields(Config):
        cls = section.default_factory  # type: ignore[misc]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            text = str(hints[f.name])
            open_type = any(t in text for t in ("int", "float", "tuple")) and "Literal" not in text
            if open_type and "rule" not in f.metadata:
                missing.append(f"{section.name}.{f.name}")
    assert missing == []


def test_recipe_names_only(tmp_path):
    for name in ("../../../etc/x", "/etc/passwd", "a/b", ".."):
        with pytest.raises(ConfigError, match=r"takes the name of a bundled recipe.*--config"):
            load_config(recipe=name)


def test_non_utf8_and_bad_yaml_name_file_and_line(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_bytes(b"training:\n  lr: 0.001\n\xff\xfe\n")
    with pytest.raises(ConfigError, match=r"x\.yaml'?: line 3 is not UTF-8"):
        load_config(config_file=str(p))
    p.write_text("training:\n  lr: [1\n")
    with pytest.raises(ConfigError, match=r"x\.yaml' is not valid YAML at line \d+, column \d+"):
        load_config(config_file=str(p))


# ---------------------------------------------------------------- hf_config_overrides


@pytest.fixture
def tiny_target_dir(tmp_path):
    import json

    d = tmp_path / "tiny"
    d.mkdir()
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 97,
        "rms_norm_eps": 1e-5,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("{nope: 1}", r"hf_config_overrides\.nope: the target config \(LlamaConfig\) has no field"),
        (
            "{num_hidden_layers: abc}",
            r"hf_config_overrides\.num_hidden_layers: LlamaConfig\.num_hidden_layers is int",
        ),
        ("{num_hidden_layers: 2.5}", r"num_hidden_layers is int"),
        ("{num_hidden_layers: 0}", r"num_hidden_layers counts or sizes something; must be >= 1"),
        ("{rms_norm_eps: abc}", r"rms_norm_eps is float"),
        (
            "{rms_norm_ep: 1.0}",
            r"has no field 'rms_norm_ep'; fields with a similar name: .*rms_norm_eps",
        ),
        ("{to_dict: 1}", r"has no field 'to_dict'"),
        ("{tie_word_embeddings: 3}", r"tie_word_embeddings is bool"),
    ],
)
def test_hf_config_overrides_checked_against_the_config_class(tiny_target_dir, override, message):
    from dflash_trainer.errors import DFlashError
    from dflash_trainer.target.configs import load_target_config
    from dflash_trainer.target.model import load_target_model

    cfg = load_config(
        overrides=[
            f"target.name_or_path={tiny_target_dir}",
            f"target.hf_config_overrides={override}",
        ]
    )
    with pytest.raises(DFlashError, match=message):
        load_target_config(cfg.target)
    with pytest.raises(DFlashError, match=message):  # before any weight is built or read
        load_target_model(cfg.target)


def test_valid_hf_config_override_applies(tiny_target_dir):
    from dflash_trainer.target.configs import load_target_config

    cfg = load_config(
        overrides=[
            f"target.name_or_path={tiny_target_dir}",
            "target.hf_config_overrides={num_hidden_layers: 2, rms_norm_eps: 1e-6}",
        ]
    )
    t = load_target_config(cfg.target)
    assert (t.num_hidden_layers, t.rms_norm_eps) == (2, 1e-6)
