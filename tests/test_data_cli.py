"""`dflash data prepare | regenerate | stats` end to end, through the real top-level CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_data_support import sharegpt, tiny_llama, tiny_tokenizer, write_jsonl

from dflash_trainer.cli import main
from dflash_trainer.data.shards import PreparedDataset, read_manifest


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def model_dir(tok_dir: Path) -> Path:
    d = tok_dir.parent / "model"
    tiny_llama(len(tiny_tokenizer())).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_prepare_then_stats(
    tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [sharegpt(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(30)] + [
        sharegpt(("human", "x"))
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "prep"
    argv = ["data", "prepare", "--input", str(src), "--tokenizer", str(tok_dir), "--out", str(out)]
    assert main([*argv, "--eval-fraction", "0.1"]) == 0
    printed = capsys.readouterr().out
    assert "31 records, 30 kept" in printed and "no_assistant_turn" in printed
    assert "[train]" in printed and "supervised tokens" in printed
    assert read_manifest(out)["tokenizer"]["spec"] == str(tok_dir)
    assert main(["data", "stats", str(out), "--verify", "--png", str(tmp_path / "h.png")]) == 0
    printed = capsys.readouterr().out
    assert "checksums: all shards OK" in printed and (tmp_path / "h.png").exists()
    # Same command again: reused. Different settings: a clear error, exit code 2.
    assert main([*argv, "--eval-fraction", "0.1"]) == 0
    capsys.readouterr()
    assert main([*argv, "--eval-fraction", "0.3"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_user_errors_exit_2_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                str(tmp_path / "nope.json"),
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert main(["data", "stats", str(tmp_path)]) == 2
    assert "dflash data prepare" in capsys.readouterr().err
    assert main(["data"]) == 2


def test_regenerate_resumes_and_its_output_prepares(
    tmp_path: Path, tok_dir: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"tell me {i}"} for i in range(5)])
    out = tmp_path / "regen.jsonl"
    argv = ["data", "regenerate", "--input", str(src), "--model", str(model_dir), "--out", str(out)]
    argv += ["--max-new-tokens", "5", "--batch-size", "2", "--device", "cpu", "--no-progress"]
    argv += ["--temperature", "1.0", "--seed", "0"]  # greedy random weights say "\\n\\n\\n..."
    assert main([*argv, "--max-records", "3"]) == 0
    assert "wrote 3 records" in capsys.readouterr().out
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "wrote 2 records" in printed and "3 already done" in printed
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == 5 and records[0]["generation"]["model"] == str(model_dir)
    # Every run of the job is logged beside the output, the HF path without engine time.
    runs = [json.loads(x) for x in (tmp_path / "regen.jsonl.runs.jsonl").read_text().splitlines()]
    assert [r["written"] for r in runs] == [3, 2] and runs[1]["already_done"] == 3
    assert runs[0]["settings"]["max_records"] == 3 and runs[1]["engine"] is None
    assert all(r["new_tokens"] > 0 and r["tokens_per_second"] > 0 for r in runs)
    # The output is training data: it prepares like any OpenAI-messages file. (Random-weight
    # answers that decode to whitespace only are skipped as empty turns, as they should be.)
    usable = sum(all(m["content"].strip() for m in r["messages"]) for r in records)
    assert usable > 0
    prep = tmp_path / "prep"
    argv = ["data", "prepare", "--input", str(out), "--tokenizer", str(tok_dir), "--out", str(prep)]
    assert main([*argv, "--eval-fraction", "0"]) == 0
    assert len(PreparedDataset(prep)) == usable


def test_regenerate_on_the_static_engine_says_where_its_time_went(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"tell me {i}"} for i in range(3)])
    out = tmp_path / "regen.jsonl"
    argv = ["data", "regenerate", "--input", str(src), "--model", str(model_dir), "--out", str(out)]
    argv += ["--max-new-tokens", "4", "--batch-size", "2", "--device", "cpu", "--no-progress"]
    assert main([*argv, "--backend", "static"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("engine:"))
    run = json.loads((tmp_path / "regen.jsonl.runs.jsonl").read_text())
    stats = run["engine"]
    assert stats["decode_steps"] > 0 and stats["prefills"] > 0
    assert f"{stats['decode_steps']:,} decode steps" in line and "rows busy" in line
