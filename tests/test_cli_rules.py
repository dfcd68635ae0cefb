"""The command-line rules every config command shares, through `dflash_trainer.cli.main`.

One override syntax (positional `a.b=v` and `--set a.b=v`, applied in command-line
order), `--recipe` takes a name only, and a config cannot let a target's repository
code run without `--trust-remote-code` on the command line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from dflash_trainer.cli import main

RECIPE = "qwen3.6-27b"  # bundled target config: no weights, no network
FIXTURE_RUN = Path(__file__).parent / "fixtures" / "run-before-layout" / "run"


def _run(argv: list[str], capsys) -> tuple[int, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out + out.err


COMMANDS = {
    "train": ["train", "--recipe", RECIPE, "--dry-run"],
    "doctor": ["doctor", "--recipe", RECIPE, "--no-tokenizer"],
    "plan": ["plan", "--recipe", RECIPE],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_config_command_takes_both_override_forms_in_order(command, capsys):
    # lr=-1 first, then --set lr=1e-3 (later wins), then a positional after an option:
    # only the last override is wrong, so the error names max_anchors and not lr.
    argv = [
        *COMMANDS[command],
        "training.lr=-1",
        "--set",
        "training.lr=1e-3",
        "training.max_anchors=0",
    ]
    rc, out = _run(argv, capsys)
    assert rc != 0
    assert "training.max_anchors: must be in [1, 16384], got 0" in out
    assert "training.lr" not in out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_set_equals_form_and_later_wins(command, capsys):
    argv = [*COMMANDS[command], "--set=training.lr=1e-3", "training.lr=.nan"]
    rc, out = _run(argv, capsys)
    assert rc != 0 and "training.lr: must be a finite number, got nan" in out


def test_a_word_that_is_not_an_override_is_still_refused(capsys):
    rc, out = _run(["plan", "--recipe", RECIPE, "--json", "stray"], capsys)
    assert rc == 2 and "override 'stray': expected section.field=value" in out
    with pytest.raises(SystemExit):
        main(["plan", "--recipe", RECIPE, "--bogus"])


@pytest.mark.parametrize("command", ["train", "doctor", "plan"])
@pytest.mark.parametrize(
    "name", ["../../../etc/x", "../recipes/qwen3-8b", "/etc/passwd", "sub/dir", "..", "a\\b"]
)
def test_recipe_takes_a_name_not_a_path(command, name, capsys):
    rc, out = _run([command, "--recipe", name], capsys)
    assert rc != 0
    assert "takes the name of a bundled recipe" in out and "--config FILE" in out


# ---------------------------------------------------------------- remote code


@pytest.fixture
def code_target(tmp_path) -> Path:
    """A local model directory that carries repository code (which must not run)."""
    d = tmp_path / "code-target"
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
    }
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modeling_custom.py").write_text("raise SystemExit('repository code ran')\n")
    return d


def _config_file(tmp_path: Path, target: Path) -> Path:
    cfg = {
        "target": {"name_or_path": str(target), "trust_remote_code": True, "dtype": "float32"},
        "drafter": {"geometry": "small", "num_layers": 1, "mask_token_id": 5},
        "run": {"output_dir": str(tmp_path / "run")},
    }
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.mark.parametrize("command", ["train", "doctor", "plan"])
def test_remote_code_from_a_config_file_needs_the_flag(command, tmp_path, code_target, capsys):
    cfg = _config_file(tmp_path, code_target)
    extra = {"train": ["--dry-run", "--skip-doctor"], "doctor": ["--no-tokenizer"], "plan": []}
    rc, out = _run([command, "--config", str(cfg), *extra[command]], capsys)
    assert rc != 0
    assert "target.trust_remote_code is true" in out and "--trust-remote-code" in out
    assert "modeling_custom.py" in out  # names what would have run


def test_with_the_flag_it_says_what_will_run(tmp_path, code_target, capsys):
    cfg = _config_file(tmp_path, code_target)
    rc, out = _run(["plan", "--config", str(cfg), "--trust-remote-code"], capsys)
    assert rc in (0, 1, 2)
    assert "--trust-remote-code: running" in out and "modeling_custom.py" in out
    assert "target.trust_remote_code is true" not in out


def test_resuming_a_run_directory_someone_sent_does_not_run_its_code(tmp_path, capsys):
    run = tmp_path / "sent-run"
    shutil.copytree(FIXTURE_RUN, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["target"]["trust_remote_code"] = True
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rc, out = _run(["train", "--resume", str(run)], capsys)
    assert rc == 2
    assert "target.trust_remote_code is true" in out and "--trust-remote-code" in out


# ---------------------------------------------------------------- config files


def test_non_utf8_config_names_the_file_and_line(tmp_path, capsys):
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"training:\n  lr: 1e-3\n  # caf\xe9\n")
    rc, out = _run(["plan", "--config", str(p)], capsys)
    assert rc == 2 and str(p) in out and "line 3 is not UTF-8" in out


def test_malformed_yaml_names_the_file_and_line(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("training:\n  lr: 1e-3\n  betas: [0.9, 0.95\n")
    rc, out = _run(["doctor", "--config", str(p)], capsys)
    assert rc != 0 and str(p) in out and "not valid YAML at line" in out


def test_malformed_override_value_is_a_config_error(capsys):
    rc, out = _run(["plan", "--recipe", RECIPE, "training.betas=[0.9,"], capsys)
    assert rc == 2 and "override 'training.betas=[0.9,'" in out
