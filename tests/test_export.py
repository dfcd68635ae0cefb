"""Export / import round trips between the project's files and the engine layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_spec
from safetensors.torch import load_file, save_file

from dflash_trainer.assets import serving_name
from dflash_trainer.cli import main
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.drafter_io import load_drafter, save_drafter_files
from dflash_trainer.formats.export import export_drafter, import_drafter

FIXTURES = Path(__file__).parent / "fixtures"
WEIGHTS = "model.safetensors"
# Source fields the export does not carry, and why (docs/formats.md says the same):
# auto_map points at a dflash.py the export does not ship; the rest are not read by
# any inference loader (initializer_range only seeds weights that are then loaded).
NOT_CARRIED = {"auto_map", "initializer_range", "transformers_version", "use_cache", "rope_scaling"}


def tiny_spec(**kw):
    kw.setdefault("layers", 2)
    kw.setdefault("layer_types", ("sliding_attention", "full_attention"))
    kw.setdefault("window", 3)
    return make_spec(**kw)


def write_run(tmp: Path, spec, meta=None, seed=0) -> tuple[Path, DFlashDrafter]:
    torch.manual_seed(seed)
    model = DFlashDrafter(spec)
    with torch.no_grad():  # non-trivial norms, so a swapped norm tensor would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    run = tmp / "run"
    save_drafter_files(run / "drafter", spec, model.state_dict(), meta or {})
    return run, model


def write_target(tmp: Path, spec, eos: int = 2) -> Path:
    """A real local HF config for a tiny Llama target (no weights needed)."""
    d = tmp / "target"
    d.mkdir()
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": spec.hidden_size,
        "intermediate_size": 128,
        "num_hidden_layers": spec.num_target_hidden_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": spec.vocab_size,
        "eos_token_id": eos,
        "bos_token_id": 1,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def step_hidden(model: DFlashDrafter, seed: int = 3) -> torch.Tensor:
    spec = model.spec
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(11, spec.num_context_features, generator=g)
    block = torch.randn(spec.block_size, spec.hidden_size, generator=g)
    cache = model.new_cache()
    model.extend_cache(cache, feats, torch.arange(11))
    return model.step(cache, block, 11)


def build(spec, state) -> DFlashDrafter:
    model = DFlashDrafter(spec)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval()


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_export_import_gives_identical_tensors_and_logits(tmp_path, fmt):
    spec = tiny_spec()
    run, model = write_run(tmp_path, spec)
    out = tmp_path / "out"
    res = export_drafter(run, out, fmt, dtype="float32")
    assert res.report.ok, res.report.render()
    spec2, state2, _ = import_drafter(out)
    assert spec2 == spec
    for name, t in model.state_dict().items():
        assert torch.equal(state2[name], t), name
    lm_head = torch.randn(spec.vocab_size, spec.hidden_size)
    with torch.no_grad():
        a = step_hidden(model.eval()) @ lm_head.T
        b = step_hidden(build(spec2, state2)) @ lm_head.T
    assert torch.equal(a, b)


def test_default_export_is_bf16_with_exact_names_and_no_embeddings(tmp_path):
    spec = tiny_spec(layers=3, layer_types=("sliding_attention",) * 2 + ("full_attention",))
    run, model = write_run(tmp_path, spec)
    export_drafter(run, tmp_path / "out", "zlab")
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(stored) == set(model.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in stored)
    for name, t in model.state_dict().items():
        assert stored[name].dtype == torch.bfloat16
        assert torch.equal(stored[name], t.to(torch.bfloat16)), name
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"


def test_zlab_config_writes_every_layout_field(tmp_path):
    spec = tiny_spec()
    run, _ = write_run(tmp_path, spec)
    export_drafter(run, tmp_path / "out", "zlab")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == spec.block_size
    assert cfg["num_target_layers"] == 8
    # 0-based and NOT shifted in this layout: vLLM / SGLang add one themselves.
    assert cfg["dflash_config"] == {
        "block_size": 4,
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": [1, 3, 5],
    }
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == spec.rope_theta
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert (cfg["sliding_window"], cfg["use_sliding_window"]) == (3, True)
    assert cfg["head_dim"] == 16
    assert cfg["tie_word_embeddings"] is False
    for key in ("rms_norm_eps", "hidden_act", "max_position_embeddings", "attention_bias"):
        assert key in cfg


def test_transformers_reads_the_zlab_config_as_written(tmp_path):
    """The z-lab loader builds a Qwen3Config from config.json; it must see our values."""
    from transformers import Qwen3Config

    spec = tiny_spec()
    run, _ = write_run(tmp_path, spec)
    export_drafter(run, tmp_path / "out", "zlab")
    cfg = Qwen3Config.from_pretrained(tmp_path / "out")
    assert cfg.sliding_window == 3
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    assert cfg.head_dim == 16
    assert cfg.rope_parameters["rope_theta"] == spec.rope_theta
    assert cfg.block_size == 4
    assert cfg.dflash_config["target_layer_ids"] == [1, 3, 5]


def test_speculators_layout_shifts_aux_ids_by_one(tmp_path):
    spec = tiny_spec()
    run, _ = write_run(tmp_path, spec, meta={"target": {"name_or_path": "org/tiny-target"}})
    export_drafter(run, tmp_path / "out", "speculators")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash"
    assert cfg["aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    assert cfg["transformer_layer_config"]["layer_types"] == cfg["layer_types"]
    assert cfg["sample_from_anchor"] is False
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "embed_tokens.weight" not in stored and "lm_head.weight" not in stored


# ----------------------------------------------------------------- z-lab fixtures


def zlab_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights whose shapes are computed here from the raw config."""
    g = torch.Generator().manual_seed(seed)
    h, d = cfg["hidden_size"], cfg.get("head_dim", 128)
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    n_ctx = len(cfg["dflash_config"]["target_layer_ids"]) * h
    inter = cfg["intermediate_size"]
    shapes = {"fc.weight": (h, n_ctx), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        shapes |= {a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h)}
        shapes |= {a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q)}
        shapes |= {a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}
        shapes |= {m + "gate_proj.weight": (inter, h), m + "up_proj.weight": (inter, h)}
        shapes |= {m + "down_proj.weight": (h, inter)}
        shapes |= {f"layers.{i}.input_layernorm.weight": (h,)}
        shapes |= {f"layers.{i}.post_attention_layernorm.weight": (h,)}
    return {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}


def zlab_dir(tmp: Path, name: str, edit=None, weights_cfg=None) -> Path:
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    d = tmp / name
    d.mkdir()
    save_file(zlab_tensors(weights_cfg or cfg), str(d / "model.safetensors"))
    if edit:
        edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_nested_fixture_imports_block_size_and_rope_from_nested_fields(tmp_path):
    spec, state, meta = import_drafter(zlab_dir(tmp_path, "zlab-tiny-nested"))
    assert spec.block_size == 4
    assert spec.rope_theta == 1e6
    assert spec.layer_types == ("sliding_attention", "full_attention")
    assert spec.sliding_window == 3
    assert spec.target_layer_ids == (1, 3, 6)
    assert spec.num_target_hidden_layers == 8
    assert meta["source"]["format"] == "zlab"
    assert meta["import_warnings"] == []
    assert all(t.dtype == torch.bfloat16 for t in state.values())


def test_flat_fixture_imports_top_level_block_size_and_flat_rope(tmp_path):
    spec, _, _ = import_drafter(zlab_dir(tmp_path, "zlab-tiny-flat"))
    assert (spec.block_size, spec.rope_theta, spec.head_dim) == (4, 10000.0, 8)
    assert spec.layer_types == ("full_attention",) * 3
    assert spec.sliding_window is None
    assert (spec.num_attention_heads, spec.num_key_value_heads) == (8, 4)


def assert_same_values(source: dict, exported: dict, path: str = "") -> None:
    for key, value in source.items():
        if key in NOT_CARRIED:
            continue
        assert key in exported, f"{path}{key} not written"
        if isinstance(value, dict):
            assert_same_values(value, exported[key], f"{path}{key}.")
        else:
            assert exported[key] == value, f"{path}{key}: {exported[key]!r} != {value!r}"


@pytest.mark.parametrize("name", ["zlab-tiny-nested", "zlab-tiny-flat"])
def test_reexport_of_an_imported_zlab_drafter_gives_back_tensors_and_config(tmp_path, name):
    src = zlab_dir(tmp_path, name)
    res = export_drafter(src, tmp_path / "re", "zlab")
    assert res.report.ok, res.report.render()
    before, after = load_file(str(src / "model.safetensors")), load_file(str(res.path / WEIGHTS))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    source_cfg = json.loads((src / "config.json").read_text())
    assert_same_values(source_cfg, json.loads((res.path / "config.json").read_text()))
    assert set(source_cfg) - NOT_CARRIED <= set(json.loads((res.path / "config.json").read_text()))


def test_missing_head_dim_defaults_to_128_like_the_zlab_loader(tmp_path):
    def drop(cfg):
        del cfg["head_dim"]

    base = json.loads((FIXTURES / "zlab-tiny-flat" / "config.json").read_text())
    real = dict(base, head_dim=128)  # the weights really have head_dim 128
    d = zlab_dir(tmp_path, "zlab-tiny-flat", edit=drop, weights_cfg=real)
    with pytest.warns(UserWarning, match="no head_dim; using 128"):
        spec, _, _ = import_drafter(d)
    assert spec.head_dim == 128


def test_missing_head_dim_with_other_weights_is_a_clear_error(tmp_path):
    def drop(cfg):
        del cfg["head_dim"]

    d = zlab_dir(tmp_path, "zlab-tiny-flat", edit=drop)
    with pytest.warns(UserWarning, match="head_dim"), pytest.raises(DFlashError, match="head_dim"):
        import_drafter(d)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(block_size=8), "block_size=8 at the top level"),
        (lambda c: c.update(rope_theta=5e5), "rope_theta=500000.0 but rope_parameters"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c["dflash_config"].update(causal=True), "dflash_config.causal"),
        (lambda c: c.pop("num_target_layers"), "num_target_layers"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "yarn"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 8]), "out of range"),
        (lambda c: c.update(sliding_window=None), "sliding_window=None"),
    ],
)
def test_inconsistent_zlab_configs_are_refused_with_the_field_named(tmp_path, edit, match):
    d = zlab_dir(tmp_path, "zlab-tiny-nested", edit=edit)
    with pytest.raises(DFlashError, match=match):
        import_drafter(d)


def test_missing_rope_theta_warns_and_uses_the_zlab_default(tmp_path):
    d = zlab_dir(tmp_path, "zlab-tiny-nested", edit=lambda c: c.pop("rope_parameters"))
    with pytest.warns(UserWarning, match="vLLM would assume 1e6"):
        spec, _, _ = import_drafter(d)
    assert spec.rope_theta == 10000.0


def test_window_without_use_sliding_window_imports_with_a_warning(tmp_path):
    d = zlab_dir(tmp_path, "zlab-tiny-nested", edit=lambda c: c.update(use_sliding_window=False))
    with pytest.warns(UserWarning, match="drops the window"):
        spec, _, _ = import_drafter(d)
    assert spec.sliding_window == 3


def test_sharded_checkpoint_is_read_through_its_index(tmp_path):
    d = zlab_dir(tmp_path, "zlab-tiny-nested")
    tensors = load_file(str(d / WEIGHTS))
    names = sorted(tensors)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half]}
    parts["model-00002-of-00002.safetensors"] = names[half:]
    weight_map = {}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(d / file))
        weight_map |= dict.fromkeys(keys, file)
    (d / WEIGHTS).unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, state, _ = import_drafter(d)
    assert all(torch.equal(state[k], tensors[k]) for k in tensors)


def test_pickle_checkpoints_are_refused_not_loaded(tmp_path):
    d = zlab_dir(tmp_path, "zlab-tiny-nested")
    (d / WEIGHTS).rename(d / "pytorch_model.bin")
    with pytest.raises(DFlashError, match="never loads"):
        import_drafter(d)


# ----------------------------------------------------------------- speculators in


def test_speculators_import_drops_verifier_tensors_and_unshifts_ids(tmp_path):
    spec = tiny_spec()
    run, model = write_run(tmp_path, spec)
    out = export_drafter(run, tmp_path / "out", "speculators", dtype="float32").path
    tensors = load_file(str(out / WEIGHTS))
    tensors["embed_tokens.weight"] = torch.randn(spec.vocab_size, spec.hidden_size)
    tensors["lm_head.weight"] = torch.randn(spec.vocab_size, spec.hidden_size)
    save_file(tensors, str(out / WEIGHTS))
    with pytest.warns(UserWarning, match="embed_tokens"):
        spec2, state, _ = import_drafter(out)
    assert spec2.target_layer_ids == spec.target_layer_ids
    assert set(state) == set(model.state_dict())


def test_speculators_without_layer_count_reads_it_from_the_target(tmp_path):
    spec = tiny_spec()
    run, _ = write_run(tmp_path, spec)
    out = export_drafter(run, tmp_path / "out", "speculators").path
    cfg = json.loads((out / "config.json").read_text())
    del cfg["num_target_layers"]  # as a speculators-trained checkpoint has it
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="--target"):
        import_drafter(out)
    target = write_target(tmp_path, spec)
    spec2, _, _ = import_drafter(out, target=str(target))
    assert spec2.num_target_hidden_layers == 8


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
        (lambda c: c.update(draft_vocab_size=32), "reduced"),
        (lambda c: c.update(sliding_window_non_causal=True), "non_causal"),
        (lambda c: c.update(aux_hidden_state_layer_ids=[0, 2, 4]), "embedding output"),
        (lambda c: c.update(speculators_model_type="dspark"), "dspark"),
        (lambda c: c.update(sliding_window=5), "sliding_window=5 at the top level"),
    ],
)
def test_speculators_variants_we_cannot_run_are_refused(tmp_path, edit, match):
    run, _ = write_run(tmp_path, tiny_spec())
    out = export_drafter(run, tmp_path / "out", "speculators").path
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=match):
        import_drafter(out)


# ----------------------------------------------------------------- CLI, card, guards


def test_cli_import_writes_project_files_that_load_back(tmp_path, capsys):
    d = zlab_dir(tmp_path, "zlab-tiny-nested")
    assert main(["import", str(d), "--out", str(tmp_path / "ours")]) == 0
    spec, state, meta = load_drafter(tmp_path / "ours")
    assert spec.block_size == 4 and spec.rope_theta == 1e6
    assert meta["source"]["format"] == "zlab"
    src = load_file(str(d / WEIGHTS))
    assert all(torch.equal(state[k], src[k]) for k in src)
    assert "2 layers" in capsys.readouterr().out


def test_cli_export_prints_serve_commands_and_card_has_tau(tmp_path, capsys):
    spec = tiny_spec()
    target = write_target(tmp_path, spec)
    meta = {
        "target": {"name_or_path": str(target)},
        "training": {"lr": 6e-4, "epochs": 6},
        "data": {"name": "sharegpt", "conversations": 1000},
        "step": 1234,
        "eval": {"tau": 3.25},
        "prepared": {"settings": {"loop_tails": "mask"}, "loop_tails": {"answers": 17}},
    }
    run, _ = write_run(tmp_path, spec, meta=meta)
    out = tmp_path / "out"
    assert main(["export", str(run), "--to", "zlab", str(out)]) == 0
    printed = capsys.readouterr().out
    assert '"num_speculative_tokens": 3' in printed
    assert "--speculative-num-draft-tokens 4" in printed
    card = (out / "README.md").read_text()
    assert "tau = 3.25" in card and "1234" in card and "sharegpt" in card
    assert "## Prepared data" in card and '"answers": 17' in card
    assert str(target) in card and "vllm serve" in card
    assert "target checks skipped" not in printed  # the meta's target was read


def _eval_report(path: Path, tau: float, speedup: float | None, device: str) -> Path:
    """The fields of a `dflash eval` report that the model card reads."""
    gsm8k = {"num_responses": 40, "tau": tau, "tau_pooled": tau - 0.1, "speedup": speedup}
    report = {
        "arguments": {"target": None, "prompts": "gsm8k,mt-bench", "max_samples": 40,
                      "max_new_tokens": 256, "temperature": 0.0, "device": device,
                      "decode": "auto", "no_baseline": speedup is None},
        "environment": {"device": device, "gpu": "NVIDIA H200" if device == "cuda" else None},
        "target": {"name_or_path": "asset:t", "dtype": "bfloat16" if device == "cuda" else "float32"},
        "sets": {"gsm8k": gsm8k},
    }  # fmt: skip
    path.mkdir()
    (path / "eval.json").write_text(json.dumps(report))
    return path


def test_export_writes_the_measured_acceptance_of_eval_reports_into_the_card(tmp_path):
    run, _ = write_run(tmp_path, tiny_spec())
    gpu = _eval_report(tmp_path / "t0", 2.26, 1.43, "cuda")
    cpu = _eval_report(tmp_path / "cpu", 2.31, None, "cpu")
    out = tmp_path / "out"
    assert main(["export", str(run), "--to", "zlab", str(out), "--eval", str(gpu),
                 "--eval", str(cpu / "eval.json")]) == 0  # fmt: skip
    card = (out / "README.md").read_text()
    assert "| gsm8k | 0 | 40 | 2.26 | 2.16 | 1.43x | NVIDIA H200, bfloat16 |" in card
    assert "| gsm8k | 0 | 40 | 2.31 | 2.21 | - | cpu, float32 |" in card
    # the target the report ran, the sets it holds (an interrupted run holds fewer)
    assert f"dflash eval --drafter {out} --target asset:t --prompts gsm8k --max" in card
    assert "--device cpu" in card and "--no-baseline" in card
    assert "Not measured yet" not in card


def test_export_refuses_an_eval_report_it_cannot_read_before_writing(tmp_path):
    run, _ = write_run(tmp_path, tiny_spec())
    (tmp_path / "bad.json").write_text('{"sets": 3}')
    for bad, why in ((tmp_path / "bad.json", "not a `dflash eval` report"),
                     (tmp_path / "missing.json", "cannot read")):  # fmt: skip
        with pytest.raises(DFlashError, match=why):
            export_drafter(run, tmp_path / "out", "zlab", evals=[str(bad)])
        assert not (tmp_path / "out").exists()


def test_export_refuses_a_non_empty_directory_unless_forced(tmp_path):
    run, _ = write_run(tmp_path, tiny_spec())
    out = tmp_path / "out"
    export_drafter(run, out, "zlab")
    with pytest.raises(DFlashError, match="not empty"):
        export_drafter(run, out, "zlab")
    export_drafter(run, out, "speculators", force=True)
    (out / "other.safetensors").write_bytes(b"")
    with pytest.raises(DFlashError, match="also holds"):
        export_drafter(run, out, "zlab", force=True)


def test_export_refuses_a_diverged_drafter(tmp_path):
    spec = tiny_spec()
    run, model = write_run(tmp_path, spec)
    state = model.state_dict()
    state["fc.weight"][0, 0] = float("nan")
    save_drafter_files(run / "drafter", spec, state)
    with pytest.raises(DFlashError, match="NaN"):
        export_drafter(run, tmp_path / "out", "zlab")
    assert not (tmp_path / "out").exists()


def test_export_of_an_export_converts_layouts(tmp_path):
    spec = tiny_spec()
    run, _ = write_run(tmp_path, spec)
    z = export_drafter(run, tmp_path / "z", "zlab").path
    s = export_drafter(z, tmp_path / "s", "speculators").path
    z2 = export_drafter(s, tmp_path / "z2", "zlab").path
    assert (z / "config.json").read_text() == (z2 / "config.json").read_text()
    a, b = load_file(str(z / WEIGHTS)), load_file(str(z2 / WEIGHTS))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_speculators_export_warns_when_vllm_cannot_find_the_verifier(tmp_path):
    meta = {"target": {"name_or_path": "asset:not-installed-anywhere"}}
    run, _ = write_run(tmp_path, tiny_spec(), meta=meta)
    res = export_drafter(run, tmp_path / "out", "speculators")
    assert res.report.ok  # a warning: the long-form serve command still works
    assert any("neither a hub id nor a local path" in p.message for p in res.report.problems)


def test_an_asset_target_is_named_by_its_hub_id_where_engines_read_it(tmp_path):
    """vLLM and SGLang cannot resolve `asset:` aliases: the verifier, the card and the serve
    commands name the hub repo the asset packages; the alias itself still loads locally."""
    assert serving_name("asset:smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert serving_name("asset:sharegpt") == "asset:sharegpt"  # data: no hub model
    assert serving_name("org/model") == "org/model" and serving_name(None) is None
    meta = {"target": {"name_or_path": "asset:smollm2-135m-instruct"}}
    run, _ = write_run(tmp_path, tiny_spec(), meta=meta)
    res = export_drafter(run, tmp_path / "out", "speculators")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == hub
    assert all("asset:" not in c for c in res.commands.values())
    assert any(hub in c for c in res.commands.values())
    card = (tmp_path / "out" / "README.md").read_text()
    assert hub in card and "asset:" not in card
    assert not any("neither a hub id" in p.message for p in res.report.problems)


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_an_export_names_its_target_and_eval_finds_the_offline_copy(tmp_path, fmt):
    """Exports name the target by hub id (z-lab: the card's base_model; speculators: the
    verifier). Reading one back records that name, and `dflash eval` without --target loads
    it from the installed asset that packages the same model."""
    from dflash_trainer.assets import installed_asset_for
    from dflash_trainer.eval.loading import _target_config

    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    meta = {"target": {"name_or_path": "asset:smollm2-135m-instruct"}}
    run, _ = write_run(tmp_path, tiny_spec(), meta=meta)
    export_drafter(run, tmp_path / "out", fmt)
    _, _, imported = import_drafter(tmp_path / "out")
    assert imported["target"] == {"name_or_path": hub}
    if installed_asset_for(hub) is None:
        pytest.skip("the SmolLM2 asset package is not installed")
    assert installed_asset_for(hub) == "asset:smollm2-135m-instruct"
    assert _target_config(imported, None, None, "cpu").name_or_path == installed_asset_for(hub)
    # An explicit --target wins; a hub id no asset packages stays as recorded.
    assert _target_config(imported, "org/other", None, "cpu").name_or_path == "org/other"
    other = {"target": {"name_or_path": "org/not-an-asset"}}
    assert installed_asset_for("org/not-an-asset") is None
    assert _target_config(other, None, None, "cpu").name_or_path == "org/not-an-asset"
