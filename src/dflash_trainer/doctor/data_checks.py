"""The doctor's checks of the training data: loss-mask coverage, document lengths against
the length limit, documents the limit leaves without a supervised token, and supervised
positions per step against training.max_anchors.

The data is read once (`load_data_sample`): every document's length and the token ids
of an even sample, which the mask-token check scans too.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_trainer.config import Config
from dflash_trainer.doctor.report import Check
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import open_input

MAX_SCAN_TOKENS = 20_000_000
"""Tokens scanned for the mask id: documents evenly spaced over the dataset up to this."""


@dataclass(frozen=True)
class DataSample:
    lengths: np.ndarray
    supervised: np.ndarray | None
    docs: list[np.ndarray]
    doc_ids: list[str]
    source: str
    first_supervised: np.ndarray | None = None
    """Per document, the first supervised position after position 0 (its length if none)."""


def load_data_sample(path: str | Path, max_tokens: int = MAX_SCAN_TOKENS) -> DataSample:
    """Lengths of every document and token ids of an even sample (prepared dir or JSONL)."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        from dflash_trainer.data.shards import PreparedDataset

        ds = PreparedDataset(p, "train")
        lengths = np.asarray(ds.lengths, dtype=np.int64)
        n = len(ds)
        mean = max(1.0, float(lengths.mean())) if n else 1.0
        k = min(n, max(1, int(max_tokens // mean)))
        picks: list[int] = (
            np.unique(np.linspace(0, n - 1, k).round().astype(int)).tolist() if n else []
        )
        docs, ids = [], []
        for i in picks:
            d = ds[int(i)]
            docs.append(d.input_ids)
            ids.append(d.doc_id)
        sup, first = ds.supervised_counts(), ds.first_supervised()
        return DataSample(lengths, sup, docs, ids, f"{p} (prepared)", first)
    if os.path.lexists(p):
        return _jsonl_sample(p, max_tokens)
    raise DFlashError(f"--data {p}: neither a prepared dataset (manifest.json) nor a JSONL file")


def _jsonl_sample(p: Path, max_tokens: int) -> DataSample:
    lengths, sup, first, docs, ids = [], [], [], [], []
    scanned = 0
    with io.TextIOWrapper(open_input(p, "--data file"), encoding="utf-8") as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                row = [int(x) for x in rec["input_ids"]]
                mask = rec.get("loss_mask")
                on = [i for i, x in enumerate(mask) if x] if mask is not None else range(len(row))
            except (KeyError, TypeError, ValueError, RecursionError, OverflowError) as e:
                raise DFlashError(
                    f"{p}:{n + 1}: expected a JSON object with input_ids ({e})"
                ) from e
            on = [i for i in on if i < len(row)]  # a mask longer than its row: the row's part
            lengths.append(len(row))
            sup.append(len(on))
            first.append(min([i for i in on if i] + [len(row)]))
            if scanned < max_tokens:
                docs.append(np.asarray(row))
                ids.append(str(rec.get("id", n)))
                scanned += len(row)
    return DataSample(
        np.asarray(lengths), np.asarray(sup), docs, ids, f"{p} (JSONL)", np.asarray(first)
    )


def check_data(cfg: Config, sample: DataSample | None) -> list[Check]:
    if sample is None:
        return [
            Check(
                "data",
                "skip",
                "no data given: coverage, length and anchor checks skipped",
                "pass --data DIR",
            )
        ]
    lengths = sample.lengths
    tokens = int(lengths.sum())
    if not len(lengths) or not tokens:
        return [
            Check(
                "data.documents", "fail", f"{sample.source}: no documents", "prepare the data again"
            )
        ]
    sup = sample.supervised
    out: list[Check] = []
    if sup is not None:
        out.append(_coverage(float(sup.sum()) / tokens, tokens))
    out.append(_length(lengths, cfg.data.doc_limit))
    first = sample.first_supervised
    if first is not None:
        out.append(_windows(lengths, first, cfg.data.doc_limit))
    if sup is not None:
        out.append(_anchors(cfg, lengths, sup, first))
    return out


def _coverage(frac: float, tokens: int) -> Check:
    if frac == 0:
        return Check(
            "data.coverage",
            "fail",
            "no supervised tokens (loss mask all zero)",
            "check the chat template / assistant masks",
        )
    if frac < 0.05:
        return Check(
            "data.coverage",
            "warn",
            f"only {100 * frac:.1f}% of tokens carry loss",
            "check the loss masks",
        )
    return Check("data.coverage", "pass", f"{100 * frac:.1f}% of {tokens:,} tokens supervised")


def _length(lengths: np.ndarray, limit: int) -> Check:
    over = int((lengths > limit).sum())
    if over:
        return Check(
            "data.length",
            "warn",
            f"{over:,} of {len(lengths):,} documents exceed {limit} tokens (data.max_doc_tokens / "
            "token_budget) and will be truncated",
            "raise data.max_doc_tokens (within data.token_budget) or accept the truncation",
        )
    return Check("data.length", "pass", f"all {len(lengths):,} documents fit {limit} tokens")


def _windows(lengths: np.ndarray, first: np.ndarray, limit: int) -> Check:
    """Documents whose first `limit` tokens supervise nothing: training leaves them out."""
    from dflash_trainer.train.batching import left_out

    clipped = np.minimum(lengths, limit)
    out = left_out(lengths, first, limit)
    n, tokens = int(out.sum()), int(clipped[out].sum())
    if n and n == int((clipped >= 2).sum()):
        return Check(
            "data.windows",
            "fail",
            f"no document supervises anything within its first {limit:,} tokens: nothing "
            "to train on",
            "raise data.max_doc_tokens (within data.token_budget), or check the loss masks",
        )
    if n and n >= 0.01 * len(lengths):
        return Check(
            "data.windows",
            "warn",
            f"{n:,} of {len(lengths):,} documents ({tokens:,} tokens) supervise nothing within "
            f"their first {limit:,} tokens: training leaves them out",
            "raise data.max_doc_tokens (within data.token_budget) to train on their answers",
        )
    left = f" ({n:,} left out: no supervised token within {limit:,})" if n else ""
    return Check("data.windows", "pass", f"documents supervise within the length limit{left}")


def _anchors(
    cfg: Config, lengths: np.ndarray, sup: np.ndarray, first: np.ndarray | None = None
) -> Check:
    """Supervised positions per step, replayed with the trainer's own batching."""
    from dflash_trainer.train.batching import epoch_steps

    limit = cfg.data.doc_limit
    d = cfg.data
    steps = epoch_steps(lengths, d.token_budget, limit, d.shuffle_seed, 0, first)
    if not steps:
        return Check("data.anchors", "skip", "no step holds a trainable document", "see above")
    ratio = np.minimum(lengths, limit) / np.maximum(lengths, 1)
    per_step = np.array([float((sup[s] * ratio[s]).sum()) for s in steps])
    med = float(np.median(per_step))
    n = cfg.training.max_anchors
    if med < n:
        return Check(
            "data.anchors",
            "warn",
            f"a step holds ~{med:.0f} supervised positions (median), fewer than "
            f"training.max_anchors={n}: steps train on fewer blocks than configured",
            "raise data.token_budget or lower training.max_anchors",
        )
    return Check(
        "data.anchors",
        "pass",
        f"~{med:,.0f} eligible anchors per step (median) for {n} sampled",
    )
