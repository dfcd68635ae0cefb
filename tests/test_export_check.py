"""`dflash export --check`: a clean export passes; each way of breaking it is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_spec
from safetensors.torch import load_file, save_file

from dflash_trainer.cli import main
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.formats.check import check_export
from dflash_trainer.formats.drafter_io import save_drafter_files
from dflash_trainer.formats.export import export_drafter, target_info

SPEC = make_spec(layers=2, layer_types=("sliding_attention", "full_attention"), window=3)


def write_target(d: Path, hidden: int = 64, layers: int = 8, eos: int = 2) -> Path:
    d.mkdir(parents=True)
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": SPEC.vocab_size,
        "eos_token_id": eos,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return write_target(tmp_path_factory.mktemp("t") / "target")


@pytest.fixture
def exported(tmp_path, target):
    def make(fmt: str = "zlab") -> Path:
        torch.manual_seed(0)
        run = tmp_path / "run"
        save_drafter_files(run / "drafter", SPEC, DFlashDrafter(SPEC).state_dict(), {})
        return export_drafter(run, tmp_path / fmt, fmt, target=str(target)).path

    return make


def edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d: Path, fn) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def check(d: Path, target: Path | None):
    t_cfg, special = target_info(str(target)) if target else (None, set())
    return check_export(d, t_cfg, special)


def failed_fields(report) -> set[str]:
    return {p.field for p in report.problems if p.severity == "error"}


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_a_fresh_export_passes_every_check(exported, target, fmt):
    report = check(exported(fmt), target)
    assert report.ok, report.render()
    assert report.problems == []


CONFIG_BREAKS = [
    (lambda c: c.pop("head_dim"), "head_dim"),
    (lambda c: c.update(rope_theta=123.0), "rope_theta"),
    (lambda c: c.pop("rope_theta"), "rope_theta"),
    (lambda c: c.pop("rope_parameters"), "rope_parameters"),
    (lambda c: c.update(use_sliding_window=False), "use_sliding_window"),
    (lambda c: c.update(sliding_window=None), "sliding_window"),
    (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 9]), "target_layer_ids"),
    (lambda c: c["dflash_config"].update(mask_token_id=2), "mask_token_id"),  # target EOS
    (lambda c: c["dflash_config"].update(mask_token_id=500), "mask_token_id"),
    (lambda c: c["dflash_config"].update(block_size=8), "block_size"),
    (lambda c: c.pop("block_size"), "block_size"),
    (lambda c: c.update(num_target_layers=9), "num_target_layers"),
    (lambda c: c.pop("num_target_layers"), "num_target_layers"),
    (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "architectures"),
    (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings"),
    (lambda c: c.update(dtype="float16", torch_dtype="float16"), "dtype"),
    (lambda c: c.pop("rms_norm_eps"), "rms_norm_eps"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c["dflash_config"].update(use_swa=True), "dflash_config.use_swa"),
    (lambda c: c.update(target_hidden_size=32), "target_hidden_size"),
]


@pytest.mark.parametrize(("edit", "field"), CONFIG_BREAKS)
def test_each_config_mistake_is_reported_with_a_fix(exported, target, edit, field):
    d = exported()
    edit_config(d, edit)
    report = check(d, target)
    assert not report.ok
    assert field in failed_fields(report), report.render()
    assert all(p.fix for p in report.problems)


def test_geometry_that_disagrees_with_the_target_is_reported(exported, tmp_path):
    d = exported()
    other = write_target(tmp_path / "bigger", hidden=128, layers=12)
    fields = failed_fields(check(d, other))
    assert {"hidden_size", "target_hidden_size", "num_target_layers"} <= fields


def transpose_k_proj(t: dict) -> None:
    k = "layers.0.self_attn.k_proj.weight"
    t[k] = t[k].T.contiguous()  # [kv*d, h] -> [h, kv*d]: same numbers, wrong layout


TENSOR_BREAKS = [
    (lambda t: t.update({"embed_tokens.weight": torch.zeros(97, 64)}), "embed_tokens.weight"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(97, 64)}), "lm_head.weight"),
    (lambda t: t["fc.weight"].view(-1).__setitem__(5, float("nan")), "fc.weight"),
    (lambda t: t["norm.weight"].__setitem__(0, float("inf")), "norm.weight"),
    (lambda t: t.pop("layers.1.mlp.up_proj.weight"), "layers.1.mlp.up_proj.weight"),
    (
        lambda t: t.update({"layers.2.input_layernorm.weight": torch.ones(64)}),
        "layers.2.input_layernorm.weight",
    ),
    (transpose_k_proj, "layers.0.self_attn.k_proj.weight"),
]


@pytest.mark.parametrize(("edit", "field"), TENSOR_BREAKS)
def test_each_tensor_mistake_is_reported(exported, target, edit, field):
    d = exported()
    edit_tensors(d, edit)
    assert field in failed_fields(check(d, target))


def test_mixed_tensor_dtypes_are_reported(exported, target):
    d = exported()
    edit_tensors(d, lambda t: t.update({"norm.weight": t["norm.weight"].float()}))
    assert "tensors" in failed_fields(check(d, target))


SPECULATORS_BREAKS = [
    (lambda c: c.update(aux_hidden_state_layer_ids=[0, 3, 5]), "aux_hidden_state_layer_ids"),
    (
        lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=4),
        "speculators_config.proposal_methods[0].speculative_tokens",
    ),
    (lambda c: c.update(sliding_window=7), "sliding_window"),
    (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
    (lambda c: c.update(draft_vocab_size=50), "draft_vocab_size"),
    (lambda c: c["transformer_layer_config"].pop("head_dim"), "head_dim"),
]


@pytest.mark.parametrize(("edit", "field"), SPECULATORS_BREAKS)
def test_speculators_mistakes_are_reported(exported, target, edit, field):
    d = exported("speculators")
    edit_config(d, edit)
    assert field in failed_fields(check(d, target))


def test_speculators_embeddings_are_a_warning_not_a_failure(exported, target):
    d = exported("speculators")
    edit_tensors(d, lambda t: t.update({"embed_tokens.weight": torch.zeros(97, 64)}))
    report = check(d, target)
    assert report.ok
    assert [p.field for p in report.problems] == ["embed_tokens.weight"]


def test_cli_check_exit_codes_and_output(exported, target, capsys):
    d = exported()
    assert main(["export", "--check", str(d), "--target", str(target)]) == 0
    assert "result: OK (0 errors" in capsys.readouterr().out
    edit_config(d, lambda c: c.pop("head_dim"))
    assert main(["export", "--check", str(d), "--target", str(target)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  head_dim: missing: the z-lab loader uses 128" in out
    assert "fix: write head_dim explicitly" in out


def test_cli_check_without_target_says_what_it_skipped(exported, capsys):
    d = exported()
    assert main(["export", "--check", str(d)]) == 0
    assert "target checks skipped" in capsys.readouterr().out


def test_cli_check_of_speculators_reads_the_target_from_the_verifier(exported, capsys):
    d = exported("speculators")  # the verifier is the local target dir
    edit_config(d, lambda c: c.update(mask_token_id=2))
    assert main(["export", "--check", str(d)]) == 1
    assert "EOS/PAD" in capsys.readouterr().out


def test_check_of_a_directory_without_config(tmp_path, capsys):
    assert main(["export", "--check", str(tmp_path)]) == 1
    assert "no config.json" in capsys.readouterr().out


# ---------------------------------------------------------------- numbers of import / check

NUMBER_BREAKS = [
    (lambda c: c["dflash_config"].update(mask_token_id=-5), "mask_token_id", "outside the vocab"),
    (lambda c: c.update(hidden_size="64"), "hidden_size", "not an integer"),
    (lambda c: c.update(rms_norm_eps="tiny"), "rms_norm_eps", "not a number"),
    (lambda c: c.update(rms_norm_eps=float("nan")), "rms_norm_eps", "outside"),
    (lambda c: c.update(num_hidden_layers=1000000), "num_hidden_layers", "outside"),
    (lambda c: c.update(block_size="16"), "block_size", "not an integer"),
    (lambda c: c["dflash_config"].update(target_layer_ids=["1", 3]), "target_layer_ids", "is"),
    (lambda c: c.update(rope_theta="big"), "rope_theta", "not a number"),
]


@pytest.mark.parametrize(("edit", "field", "why"), NUMBER_BREAKS)
def test_import_refuses_numbers_no_drafter_can_have(exported, edit, field, why, capsys):
    d = exported()
    edit_config(d, edit)
    assert main(["import", str(d)]) == 2
    err = capsys.readouterr().err
    assert "cannot import this drafter" in err and f"FAIL  {field}:" in err and why in err
    report = check(d, None)  # export --check reports the same field, without a traceback
    assert field in failed_fields(report), report.render()


def test_speculators_with_strings_where_numbers_belong(exported, capsys):
    d = exported("speculators")
    edit_config(d, lambda c: c.update(block_size="x", aux_hidden_state_layer_ids=["a"]))
    assert main(["export", "--check", str(d)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  block_size: is 'x', not an integer" in out
    assert "FAIL  aux_hidden_state_layer_ids" in out
    assert main(["import", str(d)]) == 2


def test_import_against_a_target_with_another_vocab(exported, tmp_path, capsys):
    d = exported()
    edit_config(d, lambda c: c.update(vocab_size=10))
    edit_config(d, lambda c: c["dflash_config"].update(mask_token_id=3))
    assert main(["import", str(d), "--target", str(write_target(tmp_path / "t2"))]) == 2
    err = capsys.readouterr().err
    assert f"FAIL  vocab_size: 10 but the target has {SPEC.vocab_size}" in err
