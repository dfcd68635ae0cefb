"""Hostile inputs a fresh round found past the error boundary (issue 32), each at its mechanism:

- an output path that is a FIFO or a device is refused before the command opens it (a FIFO
  blocked `data regenerate --out` for ever, `/dev/zero` was read back "to resume" for ever), and
  a file written beside such a node is never renamed over it;
- a directory output that is a link (dangling, a loop) is refused, never replaced by the new
  directory: the user's link stays;
- a target's config.json that lies (a billion layers, a hidden size its weights do not have,
  nested past the stack, a `text_config` that is a number, a vocabulary of 0, a dtype torch
  does not know) and a damaged tokenizer or chat template are one paragraph and exit 2: what
  transformers, tokenizers, jinja2 or the torch/json code they call raise on them is the
  library refusing its input, and what would build a billion modules is refused before;
- a chat template that loops for ever, or renders 100 MB (tokenized for minutes, then
  prefilled far past the model's context), is an error naming the template;
- torch's CPU allocator failing is "out of memory", not a bug.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from fuzz_support import go_offline, time_limit
from hostile_support import _spec
from lineage_chain import conversation, write_target
from test_data_support import tiny_tokenizer, write_jsonl

from dflash_trainer.atomic_dir import write_file_atomic
from dflash_trainer.cli import main
from dflash_trainer.cli_errors import USER_ERROR, report
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.drafter_io import save_drafter_files

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("world")
    target = write_target(root / "target")
    convs = write_jsonl(root / "in.jsonl", [conversation(i) for i in range(3)])
    spec = _spec(len(tiny_tokenizer()))
    meta = {"target": {"name_or_path": str(target), "dtype": "float32"}}
    save_drafter_files(root / "drafter", spec, DFlashDrafter(spec).state_dict(), meta)
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": "hello how can you help"}])
    return {"root": root, "target": target, "convs": convs, "drafter": root / "drafter",
            "prompts": prompts}  # fmt: skip


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    go_offline(monkeypatch)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str], seconds: int = 30) -> str:
    """`dflash ARGV` must end within `seconds` with exit 2 and one paragraph."""
    with time_limit(seconds, "command", wall_seconds=3 * seconds):
        rc = main(argv)
    err = capsys.readouterr().err
    assert rc == USER_ERROR and "Traceback" not in err and "internal error" not in err, err
    return " ".join(err.split())


def _prepare(world: dict[str, Path], tokenizer: Path, out: Path) -> list[str]:
    return ["data", "prepare", "--input", str(world["convs"]), "--tokenizer", str(tokenizer),
            "--out", str(out)]  # fmt: skip


def test_a_fifo_or_a_device_as_an_output_file_is_refused_at_once(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "answers.jsonl"
    os.mkfifo(fifo)
    for out, says in ((fifo, "is a FIFO"), (Path("/dev/zero"), "is a device")):
        argv = ["data", "regenerate", "--input", str(world["convs"]), "--model",
                str(world["target"]), "--out", str(out), "--device", "cpu",
                "--max-new-tokens", "2", "--max-records", "1", "--no-progress"]  # fmt: skip
        assert says in _run(argv, capsys, seconds=10)
    with pytest.raises(DFlashError, match="not a regular file"):
        write_file_atomic(fifo, b"{}")
    assert fifo.is_fifo()


@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_a_directory_output_that_is_a_link_is_refused_and_the_link_kept(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], link: str
) -> None:
    out = tmp_path / "prepared"
    out.symlink_to(tmp_path / "nowhere" if link == "dangling" else out)
    before = os.readlink(out)
    assert "link" in _run(_prepare(world, world["target"], out), capsys)
    assert out.is_symlink() and os.readlink(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]


def _damaged_target(world: dict[str, Path], tmp_path: Path, name: str, text: str) -> Path:
    copy = tmp_path / "target"
    shutil.copytree(world["target"], copy)
    (copy / name).write_text(text)
    return copy


def _config(world: dict[str, Path], **changes: object) -> str:
    config = json.loads((world["target"] / "config.json").read_text())
    return json.dumps({**config, **changes})


CONFIGS = {
    # case: (config.json changes, the commands run, what the error says)
    "a billion layers": ({"num_hidden_layers": 10**9}, "eval export", "no model has more than"),
    "a text_config that is a number": ({"text_config": 5}, "export", "not a model config"),
    "a vocabulary of 0": ({"vocab_size": 0}, "eval", "transformers refused the input"),
    "a dtype torch does not know": ({"dtype": "float99"}, "eval export", "refused the input"),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_a_config_json_that_lies_is_a_user_error(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    changes, commands, says = CONFIGS[case]
    target = _damaged_target(world, tmp_path, "config.json", _config(world, **changes))
    argvs = {
        "eval": ["eval", "--drafter", str(world["drafter"]), "--target", str(target),
                 "--prompts", str(world["prompts"]), "--max-samples", "1", "--max-new-tokens",
                 "2", "--device", "cpu", "--no-baseline", "--no-progress"],
        "export": ["export", str(world["drafter"]), "--to", "speculators", str(tmp_path / "x"),
                   "--target", str(target)],
    }  # fmt: skip
    for command in commands.split():
        err = _run(argvs[command], capsys)
        assert says in err, err
    assert not (tmp_path / "x").exists()


def test_a_config_json_nested_past_the_stack_is_a_user_error(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    target = _damaged_target(world, tmp_path, "config.json", deep)
    assert "nested more than" in _run(_prepare(world, target, tmp_path / "p"), capsys)


TOKENIZERS = {
    "tokenizer.json is not JSON": ("tokenizer.json", "not json"),
    "tokenizer_config.json is not JSON": ("tokenizer_config.json", "{nope"),
    "a template syntax error": ("chat_template.jinja", "{% for m in messages %}{{ m }"),
    "a template dividing by zero": ("chat_template.jinja", "{{ 1 // 0 }}"),
    "a template with an unknown filter": ("chat_template.jinja", "{{ messages | nosuch }}"),
}


@pytest.mark.parametrize("case", sorted(TOKENIZERS))
def test_a_damaged_tokenizer_or_template_is_a_user_error(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    name, text = TOKENIZERS[case]
    target = _damaged_target(world, tmp_path, name, text)
    _run(_prepare(world, target, tmp_path / "p"), capsys)
    assert not (tmp_path / "p").exists()


def test_a_template_that_loops_for_ever_is_stopped(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.setattr("dflash_trainer.data.template_time.RENDER_CPU_SECONDS", 1.0)
    loops = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    target = _damaged_target(world, tmp_path, "chat_template.jinja", loops)
    assert "CPU time" in _run(_prepare(world, target, tmp_path / "p"), capsys, seconds=20)


def test_a_template_rendering_100_mb_is_refused_before_tokenizing(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _damaged_target(world, tmp_path, "chat_template.jinja", "{{ 'x' * 100000000 }}")
    argv = ["eval", "--drafter", str(world["drafter"]), "--target", str(target), "--prompts",
            str(world["prompts"]), "--max-samples", "1", "--max-new-tokens", "2", "--device",
            "cpu", "--no-baseline", "--no-progress"]  # fmt: skip
    assert "100,000,000 characters" in _run(argv, capsys, seconds=20)


def test_the_cpu_allocator_failing_is_out_of_memory(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as e:
        error = e
    else:
        pytest.skip("this host allocated a petabyte")
    assert report("train", error, debug=False) == USER_ERROR
    assert "out of memory" in capsys.readouterr().err


def test_a_prompt_longer_than_the_target_context_is_refused(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny target holds 1024 positions; a prompt of ~6000 tokens is named, not decoded
    past them (a hostile prompt of millions of tokens would prefill for hours)."""
    prompts = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "hello world " * 3000}])
    argv = ["eval", "--drafter", str(world["drafter"]), "--target", str(world["target"]),
            "--prompts", str(prompts), "--max-samples", "1", "--max-new-tokens", "2",
            "--device", "cpu", "--no-baseline", "--no-progress"]  # fmt: skip
    assert "more than the target's context of 1,024" in _run(argv, capsys)


def test_token_ids_outside_the_manifest_range_are_refused(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tokens.bin changed after preparation (its checksum recomputed): the ids checked
    against the target's vocabulary are the manifest's range, so a document outside it is
    an error naming the shard, not an embedding lookup past the vocabulary."""
    import hashlib

    import numpy as np

    from dflash_trainer.data.shards import PreparedDataset

    out = tmp_path / "p"
    assert main([*_prepare(world, world["target"], out), "--eval-fraction", "0"]) == 0
    tokens = out / "train-00000" / "tokens.bin"
    ids = np.fromfile(tokens, dtype="<i4")
    ids[:] = 100_000
    ids.tofile(tokens)
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["splits"]["train"]["shards"][0]["files"]["tokens.bin"]
    entry["sha256"] = hashlib.sha256(tokens.read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DFlashError, match="outside the range"):
        PreparedDataset(out)[0]


def test_a_dtype_that_is_not_one_is_a_user_error(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--dtype -1` was looked up as an attribute of torch (AttributeError: a bug report)."""
    from dflash_trainer.data.loading import load_causal_lm

    for dtype in ("-1", "nan", "__version__"):
        with pytest.raises(DFlashError, match="--dtype"):
            load_causal_lm(world["target"], dtype=dtype)
    argv = ["data", "regenerate", "--input", str(world["convs"]), "--model", str(world["target"]),
            "--out", str(tmp_path / "r.jsonl"), "--device", "cpu", "--dtype=-1"]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == USER_ERROR and "invalid choice" in capsys.readouterr().err


def test_device_names_and_candidates_are_checked_before_torch_meets_them(
    world: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--device=-1` and `--candidates` above the vocabulary were torch RuntimeErrors reported
    as bugs."""
    argv = ["eval", "--drafter", str(world["drafter"]), "--target", str(world["target"]),
            "--prompts", str(world["prompts"]), "--max-samples", "1", "--max-new-tokens", "4",
            "--no-baseline", "--no-progress"]  # fmt: skip
    for device in ("-1", "nan", "１２", "cuda:x"):
        with pytest.raises(SystemExit) as e:
            main([*argv, f"--device={device}"])
        assert e.value.code == USER_ERROR and "--device" in capsys.readouterr().err
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU, or the first of none
    with pytest.raises(SystemExit) as e:
        main([*argv, f"--device={missing}"])
    assert f"this machine has {torch.cuda.device_count()} CUDA device" in capsys.readouterr().err
    err = _run([*argv, "--device", "cpu", "--candidates", "1000"], capsys)
    assert "more than the target's vocabulary" in err


def test_no_credential_of_storage_options_is_written_by_a_run(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The final drafter's lineage.json held the whole config, credentials included."""
    import yaml
    from lineage_chain import base_config

    prep = tmp_path / "prep"
    assert main([*_prepare(world, world["target"], prep), "--eval-fraction", "0"]) == 0
    cfg = base_config(tmp_path, world["target"], prep, tmp_path / "run")
    cfg["training"].update(max_steps=1, checkpoint_every=1)
    secrets = {"secret": "LEAKA1", "headers": ["Authorization: Bearer LEAKB2"],
               "endpoint_url": "https://u:LEAKC3@example.invalid"}  # fmt: skip
    cfg["run"]["storage_options"] = secrets
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--skip-doctor"]) == 0
    out = capsys.readouterr()
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "lineage.json" for p in written)
    for p in written:
        for leak in ("LEAKA1", "LEAKB2", "LEAKC3"):
            assert leak.encode() not in p.read_bytes(), p
            assert leak not in out.out + out.err


def test_more_ranks_than_the_host_has_are_refused_before_torchrun(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train --gpus 1_000` started a thousand ranks on a two-core host: out of memory, every
    process killed. The launcher is replaced by a failure, so a regression cannot start them."""

    def launched(args: object) -> int:
        raise AssertionError("torchrun would have been started")

    monkeypatch.setattr("dflash_trainer.train.cli._launch_torchrun", launched)
    err = _run(["train", "--recipe", "qwen3-8b", "--dry-run", "--gpus=1_000"], capsys)
    assert "--gpus 1000: this host has" in err


def test_overrides_that_name_a_class_or_resize_loaded_weights_are_refused(
    world: dict[str, Path],
) -> None:
    """`hf_config_overrides: {hidden_size: 33}` on loaded weights left a config that lies about
    them (the drafter failed on its first matmul); `model_type: bert` swapped the class under
    the planner (AttributeError). Both were reported as bugs."""
    from dflash_trainer.config_sections import TargetConfig
    from dflash_trainer.target.configs import load_target_config
    from dflash_trainer.target.model import load_target_model

    name = str(world["target"])
    with pytest.raises(DFlashError, match="the weights loaded"):
        load_target_model(TargetConfig(name_or_path=name, hf_config_overrides={"hidden_size": 33}))
    with pytest.raises(DFlashError, match="names which model this is"):
        load_target_config(
            TargetConfig(name_or_path=name, hf_config_overrides={"model_type": "bert"})
        )
    # a context length is a setting of loaded weights, and still applies
    context = {"max_position_embeddings": 2048}
    model = load_target_model(TargetConfig(name_or_path=name, hf_config_overrides=context))
    assert model.config.max_position_embeddings == 2048


def test_serve_check_fails_on_a_server_that_is_not_there_before_the_eval(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--max-samples 0 evaluates every prompt of every set (minutes on a CPU) before the
    server was first asked anything."""
    argv = ["serve-check", "--drafter", str(world["drafter"]), "--target", str(world["target"]),
            "--base-url", "http://127.0.0.1:9/v1", "--max-samples", "0",
            "--out", str(tmp_path / "sc.json")]  # fmt: skip
    _run(argv, capsys, seconds=15)
    assert not (tmp_path / "sc.json").exists()


def test_an_output_named_by_a_url_is_refused_not_written_as_a_local_directory(
    world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:  # a usage error, as argparse reports them
        main([*_prepare(world, world["target"], Path("x"))[:-1], "s3://bucket/prep"])
    assert e.value.code == USER_ERROR
    assert "--out: 's3://bucket/prep' is a URL" in capsys.readouterr().err
    msg = _run(["train", "--recipe", "smollm2-135m-demo", "run.output_dir=s3://b/run"], capsys)
    assert "run.output_dir" in msg and "run.checkpoint_dir" in msg
    assert not (tmp_path / "s3:").exists()
