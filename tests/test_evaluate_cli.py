"""`dflash eval` end to end: a tiny drafter's files against the real SmolLM2 target."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dflash_trainer.cli import main
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.formats.drafter_io import save_drafter_files

SMOLLM2 = {"name_or_path": "asset:smollm2-135m-instruct", "dtype": "float32"}


def smollm2_drafter_spec() -> DrafterSpec:
    """Shared dims of SmolLM2-135M (hidden 576, 30 layers, vocab 49152); a 1-layer drafter."""
    return DrafterSpec(
        hidden_size=576,
        vocab_size=49152,
        target_hidden_size=576,
        num_target_hidden_layers=30,
        target_layer_ids=(1, 14, 27),
        block_size=4,
        mask_token_id=16,  # <empty_output>: never in chat, not a stop token
        num_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        rope_theta=100000.0,
        layer_types=("full_attention",),
        sliding_window=None,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    )


def write_drafter(path, meta):
    spec = smollm2_drafter_spec()
    torch.manual_seed(0)
    return save_drafter_files(path, spec, DFlashDrafter(spec).state_dict(), meta)


@pytest.mark.slow
def test_dflash_eval_on_the_real_smollm2_target(tmp_path, capsys):
    drafter = write_drafter(tmp_path / "run" / "drafter", {"target": SMOLLM2})
    out, js = tmp_path / "report", tmp_path / "r.json"
    argv = ["eval", "--drafter", str(tmp_path / "run"), "--prompts", "gsm8k"]
    argv += ["--max-samples", "2", "--max-new-tokens", "6", "--out-dir", str(out)]
    argv += ["--json", str(js), "--device", "cpu"]
    assert main(argv) == 0
    report = json.loads(js.read_text())
    res = report["sets"]["gsm8k"]
    assert (res["num_prompts"], res["num_responses"], res["total_prompts"]) == (2, 2, 1319)
    assert res["lossless_mismatches"] == 0
    assert 1.0 <= res["tau"] <= 4.0 and math.isfinite(res["speedup"])
    assert all(r["new_tokens"] <= 6 and r["prompt_tokens"] > 20 for r in res["responses"])
    assert report["target"]["class"] == "LlamaForCausalLM"
    assert report["target"]["num_hidden_layers"] == 30
    assert report["drafter"]["path"] == str(tmp_path / "run")
    assert report["drafter"]["spec"]["target_layer_ids"] == [1, 14, 27]
    assert len(report["drafter"]["fingerprint"]) == 16
    assert sorted(p.name for p in out.iterdir()) == [
        "acceptance_histogram.png",
        "eval.json",
        "eval.md",
        "tau_per_set.png",
    ]
    printed = capsys.readouterr()
    assert "| gsm8k | 2 | 2 |" in printed.out
    # A progress bar over the prompts, with the running tau, on stderr.
    assert "gsm8k: 100%" in printed.err and "2/2" in printed.err and "pooled_tau=" in printed.err
    assert drafter.is_dir()
    assert res["decode"] == "eager"  # auto on a CPU
    # The static path (what CUDA graphs replay) on the real Llama target: the same tokens.
    js2 = tmp_path / "static.json"
    argv = ["eval", "--drafter", str(tmp_path / "run"), "--prompts", "gsm8k", "--max-samples"]
    argv += ["2", "--max-new-tokens", "6", "--json", str(js2), "--device", "cpu"]
    assert main([*argv, "--decode", "static", "--no-progress"]) == 0
    static = json.loads(js2.read_text())["sets"]["gsm8k"]
    assert static["decode"] == "static" and static["lossless_mismatches"] == 0
    for a, b in zip(static["responses"], res["responses"]):
        assert (a["text"], a["accepted"]) == (b["text"], b["accepted"])
    assert "pooled_tau=" not in capsys.readouterr().err


def test_a_drafter_without_a_recorded_target_asks_for_one(tmp_path, capsys):
    write_drafter(tmp_path / "d", {})
    assert main(["eval", "--drafter", str(tmp_path / "d"), "--prompts", "gsm8k"]) == 2
    assert "pass --target NAME_OR_PATH" in capsys.readouterr().err


def test_missing_drafter_and_unknown_prompt_set_are_user_errors(tmp_path, capsys):
    assert main(["eval", "--drafter", str(tmp_path / "nope")]) == 2
    assert "no such" in capsys.readouterr().err
    write_drafter(tmp_path / "d", {"target": SMOLLM2})
    assert main(["eval", "--drafter", str(tmp_path / "d"), "--prompts", "gsm8k,nope"]) == 2
    assert "not a built-in set" in capsys.readouterr().err


def test_a_zlab_export_evaluates_like_the_files_it_came_from(tmp_path):
    """--drafter accepts an export (through export.import_drafter) and --target a local dir."""
    export = pytest.importorskip("dflash_trainer.formats.export")
    from test_evaluate import word_tokenizer
    from test_speculative import drafter_spec, make_target

    target_dir, files, zlab = tmp_path / "target", tmp_path / "files", tmp_path / "zlab"
    make_target("llama").model.save_pretrained(target_dir)
    word_tokenizer().save_pretrained(target_dir)
    spec = drafter_spec(4)
    torch.manual_seed(0)
    model = DFlashDrafter(spec)
    model.reset_parameters(std=0.3)
    save_drafter_files(
        files, spec, model.state_dict(), {"target": {"name_or_path": str(target_dir)}}
    )
    export.export_drafter(files, zlab, "zlab", dtype="float32")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"w1 w2 w3"\n{"turns": ["w4 w5", "w6"]}\n')
    reports = []
    for drafter, extra in ((files, []), (zlab, ["--target", str(target_dir)])):
        out = tmp_path / f"{drafter.name}.json"
        argv = ["eval", "--drafter", str(drafter), "--prompts", str(prompts), "--device", "cpu"]
        assert main([*argv, "--max-new-tokens", "8", "--json", str(out), *extra]) == 0
        reports.append(json.loads(out.read_text()))
    a, b = (r["sets"]["p"]["responses"] for r in reports)
    assert [(r["text"], r["accepted"]) for r in a] == [(r["text"], r["accepted"]) for r in b]
    assert reports[1]["drafter"]["format"] == "zlab"
    assert reports[0]["drafter"]["fingerprint"] == reports[1]["drafter"]["fingerprint"]
