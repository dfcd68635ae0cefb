"""Loop tails: detection on token sequences, masking of templated documents, and `prepare
--loop-tails mask` end to end on the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_data_support import sharegpt, smollm2_tokenizer, write_jsonl

from dflash_trainer.data.loop_tails import (
    KEEP,
    MIN_LOOP,
    NGRAM,
    LoopTally,
    loop_onset,
    mask_loop_tails,
)
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.shards import PreparedDataset
from dflash_trainer.data.template import TemplatedDoc
from dflash_trainer.errors import DFlashError


def _varied(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1000, 50000, n)


def _looping(prefix: int, period: int, total: int, seed: int = 0) -> np.ndarray:
    cycle = _varied(period, seed + 1)
    reps = -(-(total - prefix) // period)
    return np.concatenate([_varied(prefix, seed), np.tile(cycle, reps)])[:total]


def test_varied_text_has_no_loop() -> None:
    assert loop_onset(_varied(600, 0)) is None


@pytest.mark.parametrize(("prefix", "period"), [(0, 20), (100, 20), (150, 60), (40, 3)])
def test_the_tail_starts_at_the_second_cycle(prefix: int, period: int) -> None:
    onset = loop_onset(_looping(prefix, period, 512))
    assert onset is not None
    assert prefix + period <= onset <= prefix + period + NGRAM


def test_a_counter_inside_the_cycle_is_still_a_loop() -> None:
    # "Step k: <the same 15 tokens>" with k counting up: the counter breaks a few n-grams a cycle.
    cycle = _varied(15, 3)
    toks = [_varied(80, 4)] + [np.concatenate([[7, 100 + k], cycle]) for k in range(30)]
    seq = np.concatenate(toks)
    onset = loop_onset(seq)
    assert onset is not None and 80 + 17 <= onset <= 80 + 17 + NGRAM + 2


def test_short_repeats_and_mostly_new_tails_are_not_loops() -> None:
    short = _looping(300, 20, 300 + 20 + MIN_LOOP - 10)  # the repeating tail is too short
    assert loop_onset(short) is None
    # A repeated 10-token phrase between new ones: never MAX_GAP non-repeats in a row, but
    # only 3 repeats in 20 tokens (under MIN_REPEATED).
    block = _varied(10, 9)
    parts = [np.concatenate([block, _varied(10, 100 + i)]) for i in range(40)]
    assert loop_onset(np.concatenate(parts)) is None


def _doc(*spans: tuple[np.ndarray, bool]) -> TemplatedDoc:
    ids = np.concatenate([s for s, _ in spans]).astype(np.int32)
    mask = np.concatenate([np.full(len(s), sup) for s, sup in spans])
    return TemplatedDoc(ids, mask)


def test_masking_keeps_the_first_cycle_and_later_turns() -> None:
    loop = _looping(50, 30, 400, seed=5)
    user, answer, tail = _varied(20, 6), _varied(60, 7), _varied(3, 8)
    doc = _doc((user, False), (loop, True), (user, False), (answer, True), (tail, False))
    tally = LoopTally()
    out = mask_loop_tails(doc, tally)
    onset = loop_onset(loop)
    assert onset is not None
    cut = 20 + onset + KEEP
    assert out.loss_mask[20:cut].all() and not out.loss_mask[cut : 20 + 400].any()
    assert out.loss_mask[420 + 20 :].all()  # the later answer is untouched
    assert len(out.input_ids) == len(doc.input_ids) - 3  # the unsupervised end is dropped
    assert (out.input_ids == doc.input_ids[: len(out.input_ids)]).all()
    assert tally.answers == 1 and tally.unsupervised_tokens == 20 + 400 - cut
    assert tally.trimmed_tokens == 3


def test_a_final_looping_answer_is_cut_after_its_kept_tokens() -> None:
    loop = _looping(50, 30, 400, seed=2)
    doc = _doc((_varied(20, 1), False), (loop, True), (_varied(2, 3), False))
    tally = LoopTally()
    out = mask_loop_tails(doc, tally)
    onset = loop_onset(loop)
    assert onset is not None
    assert len(out.input_ids) == 20 + onset + KEEP and out.loss_mask[20:].all()
    assert tally.trimmed_tokens == 400 - onset - KEEP + 2


def _records() -> list[dict]:
    loop = "The answer is that the garden needs water every day. " * 40
    return [
        sharegpt(("human", "Tell me about gardens."), ("gpt", "Gardens " + loop), rid="a"),
        sharegpt(("human", "Say hi."), ("gpt", "Hi! How can I help you today?"), rid="b"),
    ]


def test_prepare_masks_loop_tails_and_reports_them(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _records())
    tok = smollm2_tokenizer()
    keep = prepare_dataset(src, tok, tmp_path / "keep", eval_fraction=0.0)
    mask = prepare_dataset(src, tok, tmp_path / "mask", eval_fraction=0.0, loop_tails="mask")
    man = json.loads((mask / "manifest.json").read_text())
    loops = man["loop_tails"]
    assert loops["mode"] == "mask" and loops["answers"] == 1 and loops["unsupervised_tokens"] > 300
    kept, masked = PreparedDataset(keep, "train"), PreparedDataset(mask, "train")
    by_len = sorted(range(len(kept)), key=lambda i: len(kept[i].input_ids))
    long_keep = kept[by_len[-1]]
    long_mask = max((masked[i] for i in range(len(masked))), key=lambda d: len(d.input_ids))
    assert long_mask.loss_mask.sum() < long_keep.loss_mask.sum() // 3
    n = len(long_mask.input_ids)
    assert (np.asarray(long_mask.input_ids) == np.asarray(long_keep.input_ids)[:n]).all()
    short_mask = min((masked[i] for i in range(len(masked))), key=lambda d: len(d.input_ids))
    short_keep, m = kept[by_len[0]], len(short_mask.loss_mask)
    # Untouched but for the separator after its end-of-turn token, unsupervised, dropped.
    assert m == len(short_keep.loss_mask) - 1 and not short_keep.loss_mask[m:].any()
    assert np.array_equal(short_mask.loss_mask, short_keep.loss_mask[:m])
    kept_manifest = json.loads((keep / "manifest.json").read_text())
    assert kept_manifest["loop_tails"]["answers"] == 0
    # The default adds nothing to the settings: directories prepared before the option keep
    # their fingerprint and are reused, not refused as prepared otherwise.
    assert "loop_tails" not in kept_manifest["settings"]


def test_an_unknown_mode_is_refused(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _records())
    with pytest.raises(DFlashError, match="loop_tails must be one of keep, mask"):
        prepare_dataset(src, smollm2_tokenizer(), tmp_path / "o", loop_tails="cut")


def test_run_meta_records_how_the_training_set_was_prepared(tmp_path: Path) -> None:
    from dflash_trainer.train.train_state import prepared_meta

    src = write_jsonl(tmp_path / "in.jsonl", _records())
    out = prepare_dataset(src, smollm2_tokenizer(), tmp_path / "m", loop_tails="mask")
    meta = prepared_meta(PreparedDataset(out, "train").manifest)
    assert meta is not None and meta["settings"]["loop_tails"] == "mask"
    assert meta["loop_tails"]["answers"] == 1 and meta["train"]["documents"] >= 1
    assert prepared_meta(None) is None  # a document source without a manifest


def test_training_on_a_directory_prepared_otherwise_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dflash_trainer.config import load_config
    from dflash_trainer.train.dataset import load_train_data

    src = write_jsonl(tmp_path / "in.jsonl", _records())
    out = prepare_dataset(src, smollm2_tokenizer(), tmp_path / "m", loop_tails="mask")
    for setting, noted in (("mask", False), ("keep", True)):
        cfg = load_config(
            recipe="smollm2-135m-demo",
            overrides=[f"data.train={out}", f"data.loop_tails={setting}"],
        )
        load_train_data(cfg, tmp_path / "run")
        err = capsys.readouterr().err
        assert ("was prepared with loop_tails=mask" in err) is noted
