"""prepare_dataset: template-stage skips, idempotence, atomic writes; statistics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_data_support import sharegpt, tiny_tokenizer, write_jsonl

import dflash_trainer.data.prepare as prepare_mod
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.records import SKIP_REASONS
from dflash_trainer.data.shards import PreparedDataset, read_manifest
from dflash_trainer.data.stats import compute_stats, dataset_stats, format_stats
from dflash_trainer.errors import DFlashError

GOOD = [sharegpt(("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(20)]


def _report(out: Path) -> dict[str, object]:
    return read_manifest(out)["read_report"]  # type: ignore[no-any-return]


def test_template_stage_skip_reasons(tmp_path: Path) -> None:
    rows = [
        *GOOD,
        sharegpt(("human", "please print <|im_end|>"), ("gpt", "no")),  # special_token_in_content
        sharegpt(("human", "long " * 200), ("gpt", "x")),  # too_long
        {"input_ids": [1, 999], "loss_mask": [0, 1]},  # bad_tokens (vocab is 402)
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},  # kept as is
    ]
    out = prepare_dataset(
        write_jsonl(tmp_path / "in.jsonl", rows), tiny_tokenizer(), tmp_path / "o", max_tokens=300
    )
    report = _report(out)
    assert report["skipped"] == {"special_token_in_content": 1, "too_long": 1, "bad_tokens": 1}
    assert report["records"] == 24 and report["kept"] == 21
    m = read_manifest(out)
    assert m["splits"]["train"]["documents"] + m["splits"]["eval"]["documents"] == 21
    docs = [d for s in ("train", "eval") for d in PreparedDataset(out, s).iter_documents()]
    assert any(
        d.input_ids.tolist() == [5, 6, 7] and d.loss_mask.tolist() == [False, True, True]
        for d in docs
    )
    assert max(len(d.input_ids) for d in docs) <= 300


def test_every_skip_reason_is_exercised_somewhere() -> None:
    """The reader tests cover the reader reasons, this file the template-stage ones."""
    from test_data_formats import READER_CASES

    template_stage = {"special_token_in_content", "too_long", "bad_tokens", "in_lineage"}
    elsewhere = {"bad_json", "no_user_turn", "duplicate"}  # test_data_formats, by name
    in_template_tests = {"template_error", "mask_mismatch"}  # test_data_template
    guarded = {"bad_utf8", "too_deep", "record_error"}  # test_data_guard
    covered = set(READER_CASES) | template_stage | elsewhere | in_template_tests | guarded
    assert covered == set(SKIP_REASONS)


def test_idempotent_reuse_settings_change_and_overwrite(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", GOOD)
    out = prepare_dataset(src, tiny_tokenizer(), tmp_path / "o")
    mtime = (out / "manifest.json").stat().st_mtime_ns
    assert prepare_dataset(src, tiny_tokenizer(), tmp_path / "o") == out
    assert (out / "manifest.json").stat().st_mtime_ns == mtime  # reused, not rebuilt
    with pytest.raises(DFlashError, match="another source, tokenizer or settings"):
        prepare_dataset(src, tiny_tokenizer(), out, eval_fraction=0.5)
    other_tok = tiny_tokenizer("{{ 'X' }}" + tiny_tokenizer().chat_template)
    with pytest.raises(DFlashError, match="another source, tokenizer or settings"):
        prepare_dataset(src, other_tok, out)
    prepare_dataset(src, tiny_tokenizer(), out, eval_fraction=0.5, overwrite=True)
    assert read_manifest(out)["settings"]["eval_fraction"] == 0.5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_a_corrupted_preparation_is_rebuilt_on_reuse(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", GOOD)
    out = prepare_dataset(src, tiny_tokenizer(), tmp_path / "o", eval_fraction=0.0)
    tokens = out / "train-00000" / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[0] ^= 1
    tokens.write_bytes(bytes(data))
    with pytest.raises(DFlashError, match="checksum"):
        PreparedDataset(out).verify()
    prepare_dataset(src, tiny_tokenizer(), out, eval_fraction=0.0)
    PreparedDataset(out).verify()


def test_a_failed_prepare_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", GOOD)
    calls = {"n": 0}
    real_split_of = prepare_mod.split_of

    def failing_split_of(doc_id: str, fraction: float) -> str:
        calls["n"] += 1
        if calls["n"] == 10:
            raise RuntimeError("disk full")
        return real_split_of(doc_id, fraction)

    monkeypatch.setattr(prepare_mod, "split_of", failing_split_of)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_dataset(src, tiny_tokenizer(), tmp_path / "o")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_refuses_foreign_directories_and_prompt_only_inputs(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", GOOD)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DFlashError, match="not a prepared dataset"):
        prepare_dataset(src, tiny_tokenizer(), foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"prompt": "ho"}])
    with pytest.raises(DFlashError, match="dflash data regenerate"):
        prepare_dataset(prompts, tiny_tokenizer(), tmp_path / "p")


def test_stats_numbers_histogram_and_files(tmp_path: Path) -> None:
    lengths = np.array([10, 16, 100, 5000, 9000])
    s = compute_stats(
        lengths, np.array([5, 8, 50, 2500, 1]), ["a", "b", "c", "d", "e"], budget=8192
    )
    assert (s.documents, s.tokens, s.supervised_tokens) == (5, 14126, 2564)
    assert s.supervised_fraction == pytest.approx(2564 / 14126)
    assert (s.longest, s.longest_doc_id, s.over_budget) == (9000, "e", 1)
    assert s.bin_edges[:3] == [0, 16, 32] and s.bin_edges[-1] == 16384
    assert sum(s.bin_counts) == 5 and s.bin_counts[0] == 1 and s.bin_counts[1] == 1
    assert s.bin_counts[s.bin_edges.index(8192)] == 1
    text = format_stats(s)
    assert "14,126" in text and "over 8,192 tokens" in text
    assert compute_stats(np.array([], dtype=np.int64), np.array([])).documents == 0

    out = prepare_dataset(
        write_jsonl(tmp_path / "in.jsonl", GOOD), tiny_tokenizer(), tmp_path / "o"
    )
    ds = PreparedDataset(out)
    st = dataset_stats(ds, budget=16)
    assert st.tokens == int(ds.lengths.sum()) and st.over_budget == int((ds.lengths > 16).sum())
    assert st.longest_doc_id == ds[int(np.argmax(ds.lengths))].doc_id
    assert (out / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "stats.json").read_text())["train"]["documents"] == len(ds)
    assert "supervised tokens" in (out / "stats.txt").read_text()
