"""`dflash doctor` fails the common mistakes of a DFlash setup, naming the fields, and passes
the recipes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_spec

from dflash_trainer import cli
from dflash_trainer.config import load_config
from dflash_trainer.data.shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST, ShardWriter
from dflash_trainer.doctor.run import run_doctor

QWEN36 = "qwen3.6-27b"


def prepared_dataset(
    root: Path, docs: list[np.ndarray], masks: list[np.ndarray] | None = None
) -> Path:
    """A real prepared directory (shards + manifest) as `dflash data prepare` writes it."""
    masks = masks or [np.ones(len(d), dtype=bool) for d in docs]
    splits = {}
    for split, items in (("train", list(zip(docs, masks))), ("eval", [])):
        w = ShardWriter(root, split, shard_tokens=1 << 12)
        for i, (ids, m) in enumerate(items):
            w.add(f"doc{i}", np.asarray(ids, dtype=np.int32), np.asarray(m, dtype=bool))
        entries = w.close()
        splits[split] = {
            "documents": sum(e["documents"] for e in entries),
            "tokens": sum(e["tokens"] for e in entries),
            "supervised_tokens": sum(e["supervised_tokens"] for e in entries),
            "shards": entries,
        }
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "splits": splits}
    (root / MANIFEST).write_text(json.dumps(manifest))
    return root


def _doctor(overrides: list[str], **kw):
    cfg = load_config(recipe=QWEN36, overrides=overrides)
    return run_doctor(cfg, hardware=kw.pop("hardware", "h200"), env={}, **kw)


def _failing(report, check_id: str) -> str:
    fails = [c for c in report.failures if c.id == check_id]
    assert fails, report.format()
    return fails[0].message


def test_published_recipe_passes():
    report = _doctor([], hardware="rtx-pro-6000", gpus=4)
    assert not report.failed, report.format()
    assert {c.id for c in report.checks} >= {
        "geometry.independent",
        "layers.range",
        "layers.hybrid",
        "mask.special",
        "memory.target",
        "memory.drafter",
        "compile.cache",
    }


def test_geometry_copied_from_the_target_fails():
    report = _doctor(
        ["drafter.num_attention_heads=24", "drafter.num_key_value_heads=4", "drafter.head_dim=256"]
    )
    msg = _failing(report, "geometry.copied")
    for field in ("drafter.num_attention_heads", "num_key_value_heads", "head_dim", "24/4/256"):
        assert field in msg
    assert "32/8/128" in msg and "its weights cannot load into it" in msg


def test_copied_geometry_of_a_target_without_published_drafter_warns():
    cfg = load_config(
        recipe=QWEN36,
        overrides=[
            "drafter.num_attention_heads=24",
            "drafter.num_key_value_heads=4",
            "drafter.head_dim=256",
            "target.hf_config_overrides={num_hidden_layers: 32}",
            "drafter.target_layer_ids=[1, 9, 17, 25, 30]",
        ],
    )
    report = run_doctor(cfg, hardware="h200", env={})
    (copied,) = report.get("geometry.copied")
    assert copied.status == "warn"
    assert "bigger, slower drafter" in copied.message and "docs/algorithm.md" in copied.message


def test_llama_class_with_24_heads_on_hidden_5120_fails():
    report = _doctor(["drafter.layer_class=llama", "drafter.num_attention_heads=24"])
    msg = _failing(report, "geometry.divisibility")
    assert "drafter.num_attention_heads" in msg and "drafter.layer_class=llama" in msg
    assert "5120 % 24 = 8" in msg and "LlamaConfig rejects" in msg


def test_target_layer_id_64_on_a_64_layer_target_fails():
    report = _doctor(["drafter.target_layer_ids=[1, 16, 31, 46, 64]"])
    msg = _failing(report, "layers.range")
    assert "drafter.target_layer_ids" in msg and "[64]" in msg and "0..63" in msg
    # The memory check cannot plan this config; it says so instead of crashing.
    assert report.get("memory.fit")[0].status == "skip"


def test_mask_token_in_the_data_fails(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 240000, size=n) for n in (300, 800, 50)]
    docs[1][17] = 248070  # the recipe's mask id, once, in the middle of a document
    data = prepared_dataset(tmp_path / "data", docs)
    report = _doctor([], data=data)
    msg = _failing(report, "mask.data")
    assert "drafter.mask_token_id=248070" in msg and "occurs 1 times" in msg and "doc1" in msg


def test_mask_token_absent_from_clean_data_passes(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 240000, size=n) for n in (300, 800)]
    masks = [np.arange(len(d)) >= len(d) // 2 for d in docs]
    report = _doctor([], data=prepared_dataset(tmp_path / "d", docs, masks))
    (c,) = report.get("mask.data")
    assert c.status == "pass"
    (cov,) = report.get("data.coverage")
    assert cov.status == "pass" and "50.0%" in cov.message
    # Both documents fit one step: 150 + 400 supervised positions for 512 anchors.
    (anchors,) = report.get("data.anchors")
    assert anchors.status == "pass" and "~550" in anchors.message
    few = _doctor(["training.max_anchors=1024"], data=tmp_path / "d")
    (anchors,) = few.get("data.anchors")
    assert anchors.status == "warn" and "training.max_anchors=1024" in anchors.message


def test_mask_token_in_jsonl_data_fails(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"input_ids": [5, 6, 248070, 7]}, {"input_ids": [1, 2, 3]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _failing(_doctor([], data=path), "mask.data")


def test_mask_token_that_is_eos_fails():
    report = _doctor(["drafter.mask_token_id=248044"])
    assert "eos_token_id" in _failing(report, "mask.special")


def test_compile_off_where_unfused_does_not_fit_fails():
    report = _doctor(["training.compile=false"], hardware="rtx-pro-6000", gpus=4)
    msg = _failing(report, "memory.unfused")
    assert "training.compile=false" in msg
    assert any(c.id == "training.compile" and c.status == "warn" for c in report.checks)


def test_memory_that_does_not_fit_fails():
    report = _doctor(["distributed.placement=colocated"], hardware="h100")
    msg = _failing(report, "memory.colocated")
    assert "does not fit" in msg


def test_hybrid_taps_all_one_kind_warns():
    report = _doctor(["drafter.target_layer_ids=[0, 1, 2, 4, 5]"])
    (c,) = report.get("layers.hybrid")
    assert c.status == "warn" and "linear_attention" in c.message


def test_sliding_and_training_warnings():
    report = _doctor(["training.noise_std=0", "drafter.sliding_window=8192"])
    ids = {c.id for c in report.warnings}
    assert {"training.noise", "sliding.length"} <= ids


def test_compile_off_multiprocess_hybrid_warns_about_shared_triton_cache():
    cfg = load_config(recipe=QWEN36, overrides=["training.compile=false"])
    report = run_doctor(cfg, hardware="b200", gpus=4, env={})
    (c,) = report.get("compile.cache")
    assert c.status == "warn" and "TRITON_CACHE_DIR" in c.fix


def test_tensor_parallel_divisibility():
    report = _doctor(["distributed.tensor_parallel_size=3"])
    assert "distributed.tensor_parallel_size=3" in _failing(report, "geometry.tensor_parallel")


@pytest.mark.parametrize(
    ("overrides", "code"),
    [([], 0), (["drafter.target_layer_ids=[1, 16, 31, 46, 64]"], 1), (["training.nope=1"], 1)],
)
def test_cli_exit_codes(capsys, overrides, code):
    argv = ["doctor", "--recipe", QWEN36, "--hardware", "h200", "--no-tokenizer"]
    for o in overrides:
        argv += ["--set", o]
    assert cli.main(argv) == code
    out = capsys.readouterr().out
    assert "doctor:" in out or "[FAIL] config" in out


def test_cli_json(capsys):
    assert cli.main(["doctor", "--recipe", QWEN36, "--json", "--no-tokenizer"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["failed"] is False and len(data["checks"]) > 10


def test_init_from_a_drafter_of_another_target_fails(tmp_path):
    from dflash_trainer.config import TargetConfig
    from dflash_trainer.core.drafter import DFlashDrafter
    from dflash_trainer.core.geometry import resolve_drafter_spec
    from dflash_trainer.formats.drafter_io import save_drafter_files
    from dflash_trainer.target.configs import load_target_config

    small = load_config(
        recipe=QWEN36,
        overrides=[
            "drafter.num_layers=1",
            "drafter.intermediate_size=64",
            "drafter.layer_types=null",
        ],
    )
    spec = resolve_drafter_spec(
        small.drafter, load_target_config(TargetConfig(name_or_path="Qwen/Qwen3.6-27B"))
    )
    # A drafter for the same target with another geometry; spec.json is what the check reads.
    with torch.device("meta"):
        model = DFlashDrafter(spec)
    state = {k: torch.zeros(1) for k in model.state_dict()}
    d = save_drafter_files(tmp_path / "drafter", spec, state)
    msg = _failing(_doctor([f"drafter.init_from={d}"]), "geometry.init_from")
    assert "num_layers: 1 there vs 5 here" in msg and "intermediate_size" in msg


def test_init_from_a_zlab_export_is_compared_by_its_config(tmp_path):
    from dflash_trainer.config import TargetConfig
    from dflash_trainer.core.geometry import resolve_drafter_spec
    from dflash_trainer.formats.zlab import zlab_config
    from dflash_trainer.target.configs import load_target_config

    small = load_config(
        recipe=QWEN36,
        overrides=["drafter.num_layers=1", "drafter.layer_types=null"],
    )
    spec = resolve_drafter_spec(
        small.drafter, load_target_config(TargetConfig(name_or_path="Qwen/Qwen3.6-27B"))
    )
    # The check reads the export's config.json only (no weights are needed to compare).
    d = tmp_path / "zlab"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(zlab_config(spec, "bfloat16")))
    msg = _failing(_doctor([f"drafter.init_from={d}"]), "geometry.init_from")
    assert "num_layers: 1 there vs 5 here" in msg
    same = _doctor([f"drafter.init_from={d}", "drafter.num_layers=1", "drafter.layer_types=null"])
    assert [c.status for c in same.checks if c.id == "geometry.init_from"] == ["pass"]


def test_a_sliding_window_no_layer_uses_is_no_difference():
    import dataclasses

    from dflash_trainer.core.geometry import init_differences

    spec = make_spec()
    full = dataclasses.replace(spec, layer_types=("full_attention",) * len(spec.layer_types))
    assert (
        init_differences(
            dataclasses.replace(full, sliding_window=None),
            dataclasses.replace(full, sliding_window=2048),
        )
        == {}
    )
    mixed = dataclasses.replace(full, layer_types=("sliding_attention", *full.layer_types[1:]))
    diffs = init_differences(
        dataclasses.replace(mixed, sliding_window=1024),
        dataclasses.replace(full, sliding_window=2048),
    )
    assert diffs["sliding_window"] == (1024, 2048) and "layer_types" in diffs


def test_dflash2_fields_are_checked_against_the_target():
    ok = _doctor(["drafter.kind=dflash2"])
    assert [c.status for c in ok.checks if c.id == "geometry.dflash2"] == ["pass"]
    assert "248320 tokens" in next(c.message for c in ok.checks if c.id == "geometry.dflash2")
    bad = _doctor(["drafter.kind=dflash2", "drafter.conv_group_size=48"])
    assert "does not divide hidden_size=5120" in _failing(bad, "geometry.dflash2")
    big = _doctor(["drafter.kind=dflash2", "drafter.selector_top_k=4000"])
    assert "selector_top_k=4000 exceeds" not in str(big.failures)  # within the vocab: fine
    plain = _doctor([])
    assert not [c for c in plain.checks if c.id == "geometry.dflash2"]
