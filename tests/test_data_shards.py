"""Shards: round trip, streaming reads from the files, checksums, the stable split."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from test_data_support import tiny_tokenizer, write_jsonl

from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.records import content_hash
from dflash_trainer.data.shards import PreparedDataset, read_manifest
from dflash_trainer.data.split import split_key, split_of
from dflash_trainer.errors import DFlashError


def _rows(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(1, 60)
        mask = [rng.random() < 0.6 for _ in range(length)]
        mask[rng.randrange(length)] = True
        rows.append({"input_ids": [rng.randrange(400) for _ in range(length)], "loss_mask": mask})
    return rows


@pytest.fixture
def prepared(tmp_path: Path) -> tuple[Path, list[dict[str, list[int]]]]:
    rows = _rows(120)
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = prepare_dataset(
        src, tiny_tokenizer(), tmp_path / "prep", eval_fraction=0.2, shard_tokens=500
    )
    return out, rows


def test_round_trip_over_many_shards(prepared: tuple[Path, list[dict[str, list[int]]]]) -> None:
    out, rows = prepared
    by_id = {
        content_hash(
            {"input_ids": r["input_ids"], "loss_mask": [bool(m) for m in r["loss_mask"]]}
        ): r
        for r in rows
    }
    manifest = read_manifest(out)
    assert len(manifest["splits"]["train"]["shards"]) > 3  # small shards: several of them
    seen = []
    for split in ("train", "eval"):
        ds = PreparedDataset(out, split)
        assert len(ds) == manifest["splits"][split]["documents"]
        assert (
            ds.lengths.dtype == np.int64
            and int(ds.lengths.sum()) == manifest["splits"][split]["tokens"]
        )
        streamed = list(ds.iter_documents())
        assert len(streamed) == len(ds)
        for i, doc in enumerate(streamed):
            row = by_id[doc.doc_id]
            assert doc.input_ids.dtype == np.int32 and doc.loss_mask.dtype == np.bool_
            assert doc.input_ids.tolist() == row["input_ids"]
            assert doc.loss_mask.tolist() == [bool(m) for m in row["loss_mask"]]
            assert ds.lengths[i] == len(row["input_ids"])
            assert ds[i].doc_id == doc.doc_id
            assert split_of(doc.doc_id, 0.2) == split
            seen.append(doc.doc_id)
        assert int(ds.supervised_counts().sum()) == manifest["splits"][split]["supervised_tokens"]
        if len(ds):
            assert ds[-1].doc_id == streamed[-1].doc_id
        with pytest.raises(IndexError):
            ds[len(ds)]
    assert sorted(seen) == sorted(by_id)


def test_reads_go_to_the_files_and_verify_names_the_corrupted_shard(
    prepared: tuple[Path, list[dict[str, list[int]]]],
) -> None:
    out, _ = prepared
    ds = PreparedDataset(out, "train")
    ds.verify()
    shard = read_manifest(out)["splits"]["train"]["shards"][2]
    d = out / shard["name"]
    offsets = np.load(d / "offsets.npy")
    j = 1  # flip the first token of the shard's second document, same file size
    i = sum(s["documents"] for s in read_manifest(out)["splits"]["train"]["shards"][:2]) + j
    before = ds[i].input_ids.copy()
    tokens = np.memmap(d / "tokens.bin", dtype="<i4", mode="r+")
    tokens[offsets[j]] = before[0] + 1
    tokens.flush()
    del tokens
    # Opened after the change: documents are read from the file on demand, not from a copy.
    assert PreparedDataset(out, "train")[i].input_ids[0] == before[0] + 1
    with pytest.raises(DFlashError, match=f"shard {shard['name']}.*tokens.bin fails its checksum"):
        PreparedDataset(out, "train").verify()


def test_truncated_or_missing_shard_files_fail_at_open(
    prepared: tuple[Path, list[dict[str, list[int]]]],
) -> None:
    out, _ = prepared
    name = read_manifest(out)["splits"]["train"]["shards"][1]["name"]
    mask = out / name / "mask.bin"
    mask.write_bytes(mask.read_bytes()[:-3])
    with pytest.raises(DFlashError, match=f"shard {name}: mask.bin has .* bytes"):
        PreparedDataset(out)
    mask.unlink()
    with pytest.raises(DFlashError, match=f"shard {name}: mask.bin is missing"):
        PreparedDataset(out)


def test_not_a_prepared_dir_and_unknown_split(
    tmp_path: Path, prepared: tuple[Path, object]
) -> None:
    with pytest.raises(DFlashError, match="dflash data prepare"):
        PreparedDataset(tmp_path / "nothing")
    with pytest.raises(DFlashError, match="no split 'test'"):
        PreparedDataset(prepared[0], "test")
    m = json.loads((prepared[0] / "manifest.json").read_text())
    m["version"] = 99
    (prepared[0] / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DFlashError, match="prepare the data again"):
        PreparedDataset(prepared[0])


def test_split_is_a_stable_function_of_the_id_with_the_right_fraction() -> None:
    ids = [content_hash({"n": i}) for i in range(20000)]
    frac = np.mean([split_of(i, 0.1) == "eval" for i in ids])
    assert 0.09 < frac < 0.11
    # Growing the eval fraction only moves documents from train to eval, never back.
    assert all(split_of(i, 0.2) == "eval" for i in ids if split_of(i, 0.1) == "eval")
    assert split_key(ids[0]) == split_key(ids[0]) and 0 <= split_key(ids[0]) < 1
    assert all(split_of(i, 0.0) == "train" for i in ids[:100])
    with pytest.raises(ValueError, match="eval_fraction"):
        split_of(ids[0], 1.0)


def test_split_does_not_depend_on_order_or_on_the_other_documents(tmp_path: Path) -> None:
    rows = _rows(80, seed=3)
    a = prepare_dataset(
        write_jsonl(tmp_path / "a.jsonl", rows), tiny_tokenizer(), tmp_path / "a", eval_fraction=0.3
    )
    shuffled = rows[40:][::-1] + _rows(30, seed=4)
    b = prepare_dataset(
        write_jsonl(tmp_path / "b.jsonl", shuffled),
        tiny_tokenizer(),
        tmp_path / "b",
        eval_fraction=0.3,
    )
    split_a = {
        d.doc_id: s for s in ("train", "eval") for d in PreparedDataset(a, s).iter_documents()
    }
    split_b = {
        d.doc_id: s for s in ("train", "eval") for d in PreparedDataset(b, s).iter_documents()
    }
    common = set(split_a) & set(split_b)
    assert len(common) == 40
    assert all(split_a[i] == split_b[i] for i in common)
    assert {"train", "eval"} == set(split_a.values())


def _varied_rows(n: int, seed: int = 1) -> list[dict[str, list]]:
    """Rows of 1 to 700 tokens, masks from sparse to full: counts from 1 to past 255 (prepare
    drops a row that supervises nothing)."""
    rng = random.Random(seed)
    rows: list[dict[str, list]] = []
    for k in range(n):
        length = rng.choice([1, 2, rng.randint(3, 40), rng.randint(280, 700)])
        density = (0.02, 0.1, 0.9, 1.0)[k % 4]
        mask = [rng.random() < density for _ in range(length)]
        rows.append({"input_ids": [rng.randrange(400) for _ in range(length)], "loss_mask": mask})
    return rows


def test_supervised_counts_summed_in_chunks_are_the_masks_sums(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "rows.jsonl", _varied_rows(90))
    out = prepare_dataset(
        src, tiny_tokenizer(), tmp_path / "prep", eval_fraction=0.0, shard_tokens=2000
    )
    ds = PreparedDataset(out, "train")
    want = [int(d.loss_mask.sum()) for d in ds.iter_documents()]  # one document at a time
    assert len(ds._shards) > 3 and max(want) > 255  # a uint8 sum would wrap
    got = ds.supervised_counts()
    assert got.dtype == np.int64 and got.tolist() == want
    # Chunks smaller than a document, around document sizes, and past a shard's end.
    for chunk in (1, 2, 3, 7, 64, 301, 5000):
        per_shard = [s.supervised_counts(chunk) for s in ds._shards]
        assert np.concatenate(per_shard).tolist() == want, chunk


def test_supervised_counts_never_widen_the_whole_shard(tmp_path: Path) -> None:
    import tracemalloc

    src = write_jsonl(tmp_path / "rows.jsonl", _varied_rows(200, seed=2))
    out = prepare_dataset(src, tiny_tokenizer(), tmp_path / "prep", eval_fraction=0.0)
    shard = PreparedDataset(out, "train")._shards[0]  # one shard holds every document
    tokens = int(shard.offsets[-1])
    want = shard.supervised_counts()  # maps the files before memory is measured
    tracemalloc.start()
    try:
        got = shard.supervised_counts(chunk=256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.tolist() == want.tolist()
    assert tokens > 10_000 and peak < 2 * tokens  # the shard as int64 would be 8 x tokens
