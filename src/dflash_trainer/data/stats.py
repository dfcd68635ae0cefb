"""Dataset statistics: sizes, supervision, the length histogram (text and PNG), over-budget docs.

The histogram uses power-of-two bins because chat lengths span four orders of magnitude and the
questions asked of it are about budgets (how many documents fit in 2k, 4k, 8k tokens).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_trainer.atomic_dir import save_png
from dflash_trainer.data.shards import PreparedDataset
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import open_regular


@dataclass(frozen=True)
class DatasetStats:
    documents: int
    tokens: int
    supervised_tokens: int
    supervised_fraction: float
    mean_length: float
    median_length: float
    longest: int
    longest_doc_id: str
    budget: int
    over_budget: int
    """Documents longer than `budget` tokens (the trainer's per-batch token budget)."""
    bin_edges: list[int]
    """Histogram bins [edges[i], edges[i+1]) in tokens."""
    bin_counts: list[int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_stats(
    lengths: np.ndarray,
    supervised: np.ndarray,
    doc_ids: list[str] | None = None,
    budget: int = 8192,
) -> DatasetStats:
    """Statistics of documents given their lengths and supervised-token counts."""
    n = len(lengths)
    if n == 0:
        return DatasetStats(0, 0, 0, 0.0, 0.0, 0.0, 0, "", budget, 0, [], [])
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens, sup = int(lengths.sum()), int(np.asarray(supervised, dtype=np.int64).sum())
    top = int(np.argmax(lengths))
    # The last edge 2**k is > the longest length, so every bin is [lo, hi) with integer ends.
    k_max = max(4, int(np.ceil(np.log2(int(lengths.max()) + 1))))
    edges = [0] + [2**k for k in range(4, k_max + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    return DatasetStats(
        documents=n,
        tokens=tokens,
        supervised_tokens=sup,
        supervised_fraction=sup / tokens if tokens else 0.0,
        mean_length=float(lengths.mean()),
        median_length=float(np.median(lengths)),
        longest=int(lengths[top]),
        longest_doc_id=doc_ids[top] if doc_ids is not None else str(top),
        budget=budget,
        over_budget=int((lengths > budget).sum()),
        bin_edges=edges,
        bin_counts=[int(c) for c in counts],
    )


def dataset_stats(dataset: PreparedDataset, budget: int = 8192) -> DatasetStats:
    lengths = dataset.lengths
    longest_id = dataset[int(np.argmax(lengths))].doc_id if len(lengths) else ""
    s = compute_stats(lengths, dataset.supervised_counts(), None, budget)
    return DatasetStats(**{**asdict(s), "longest_doc_id": longest_id})


def format_stats(s: DatasetStats, title: str = "") -> str:
    lines = [title] if title else []
    lines += [
        f"documents            {s.documents:>14,}",
        f"tokens               {s.tokens:>14,}",
        f"supervised tokens    {s.supervised_tokens:>14,}  ({100 * s.supervised_fraction:.1f}%)",
        f"mean / median length {s.mean_length:>14,.1f} / {s.median_length:,.0f}",
        f"longest document     {s.longest:>14,}  ({s.longest_doc_id})",
        f"over {s.budget:,} tokens {s.over_budget:>13,}",
        "length histogram (tokens):",
    ]
    peak = max(s.bin_counts, default=0)
    first = next((i for i, c in enumerate(s.bin_counts) if c), len(s.bin_counts))
    for i, c in enumerate(s.bin_counts):
        if i < first:
            continue  # leading empty bins say nothing
        label = f"{s.bin_edges[i]:>7,} - {s.bin_edges[i + 1] - 1:>7,}"
        bar = "#" * (round(40 * c / peak) if peak else 0)
        lines.append(f"  {label}  {c:>8,}  {bar}")
    return "\n".join(lines)


def plot_lengths(lengths: np.ndarray, path: Path, budget: int, title: str = "") -> Path:
    """A PNG histogram of document lengths (log-spaced bins) with the token budget marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if len(lengths):
        bins = np.logspace(0, np.log10(max(int(lengths.max()), 2)), 50).tolist()
        ax.hist(lengths, bins=bins, color="#4477aa")
        ax.set_xscale("log")
    ax.axvline(budget, color="#cc3311", linestyle="--", label=f"budget {budget:,}")
    ax.set_xlabel("tokens per document")
    ax.set_ylabel("documents")
    ax.set_title(title or "document lengths")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=100)
    plt.close(fig)
    return path


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_png_path(path: Path, flag: str) -> Path:
    """A path to write a PNG to: named `.png`, and not an existing file that is not a PNG (a
    manifest or a shard named by mistake is never replaced by a picture)."""
    from dflash_trainer.outputs import output_file

    p = output_file(path, flag)
    if p.suffix.lower() != ".png":
        raise DFlashError(f"{flag} {path}: name a .png file (the histogram is a PNG image)")
    if os.path.lexists(p):
        try:
            with open_regular(p, flag) as f:
                head = f.read(len(PNG_MAGIC))
        except DFlashError as e:
            raise DFlashError(f"{e}; nothing was replaced") from e
        if head != PNG_MAGIC:
            raise DFlashError(
                f"{flag} {p} exists and is not a PNG image; nothing was replaced: give "
                "another path or move it aside"
            )
    return p
