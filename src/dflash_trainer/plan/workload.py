"""What one training step holds, on average, for a dataset: the planner's input shapes.

Shape legend: D = documents in a step, L = a document's length (truncated to the
doc limit), T = packed context length, N = anchors, B = block size, Q = N*B queries,
KV = T + Q keys, R = slots that carry a loss.

The shapes come from replaying the trainer's own rules on the dataset's real lengths
(or on documents of `mean_tokens` each when only the mean is known):
`batching.epoch_steps` cuts the epoch into token-budget steps, leaving out the documents
the trainer leaves out (`batching.left_out`: nothing supervised after position 0 within
data.max_doc_tokens, known where the dataset's masks are read); the target runs each
step as the trainer's length-sorted right-padded micro-batches (`step._micro_batches`),
so its compute follows rows x longest, not the real token count; with compile on, the
pack and the anchor count are padded to fixed shapes exactly as `StepSettings` says.
The drafter's attention pairs are counted with the project's packing, anchor sampling
and mask intervals on a few representative packs (a prompt first, the supervised
answer last in every document), so planner and trainer cannot disagree on the rule.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from dflash_trainer.config import Config
from dflash_trainer.core.anchors import sample_anchors
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.core.masks import FLEX_BLOCK, build_intervals
from dflash_trainer.core.packing import Pack, pack_documents
from dflash_trainer.errors import DFlashError
from dflash_trainer.train.batching import epoch_steps
from dflash_trainer.train.fast_layout import (
    fast_shapes,
    layout_cost,
    planned_fast,
    whole_pack_cost,
)
from dflash_trainer.train.step import StepSettings, _micro_batches, anchor_pad, settings_from_config

MAX_REPLAY_DOCS = 200_000
"""Replaying more documents changes the averages by less than a percent; cap the cost."""
PAIR_SAMPLE_PACKS = 6
"""Packs on which attention pairs are counted exactly (each costs a few milliseconds)."""


@dataclass(frozen=True)
class DataStats:
    """What the planner needs to know about the training documents."""

    documents: int
    lengths: np.ndarray | None
    """int64 per-document token counts (None: all documents are `mean_tokens` long)."""
    mean_tokens: float
    supervised_fraction: float
    """Fraction of tokens with loss (assistant text)."""
    source: str
    """Where the numbers came from (manifest path, flags, assumption)."""
    first_supervised: np.ndarray | None = None
    """int64 per document, aligned with `lengths`: the first supervised position after
    position 0 (its length if none), from which the epoch leaves documents out (None: every
    document is taken to supervise something in its window)."""

    @staticmethod
    def uniform(
        documents: int, mean_tokens: float, supervised_fraction: float, source: str
    ) -> DataStats:
        return DataStats(documents, None, float(mean_tokens), supervised_fraction, source)


@dataclass(frozen=True)
class AttentionPairs:
    """Query-key pairs per drafter layer of one kind, per step."""

    dense: float
    """Q x KV: what a dense-mask (SDPA / eager) kernel computes."""
    visible: float
    """Pairs the attention rule allows (the model's FLOPs)."""
    tiles: float
    """Pairs in the 128x128 tiles a block-sparse FlexAttention kernel touches."""


@dataclass(frozen=True)
class StepShape:
    """Mean shapes of one training step (one data-parallel rank)."""

    docs: float
    target_tokens: float
    """Real tokens the target reads."""
    target_padded_tokens: float
    """Sum over micro-batches of rows x longest: tokens the padded target batches compute."""
    target_max_len: float
    """Mean longest document of a target micro-batch."""
    target_micro_batches: float
    """Right-padded target forwards per step (rows x longest <= target_batch_tokens)."""
    target_attn_pairs: float
    """Sum over micro-batches of rows x longest^2 (a padded dense-mask kernel computes all)."""
    ctx_len: int
    """T: packed drafter context, padded to the FlexAttention block."""
    anchors: int
    """N anchors per step."""
    block_size: int
    rows: float
    """R: slots with a loss, through the lm_head."""
    pairs: dict[str, AttentionPairs] = field(default_factory=dict)
    """Per drafter layer kind (full_attention / sliding_attention)."""
    steps_per_epoch: float = 0.0

    @property
    def queries(self) -> int:
        return self.anchors * self.block_size

    @property
    def kv_len(self) -> int:
        return self.ctx_len + self.queries

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["queries"] = self.queries
        d["kv_len"] = self.kv_len
        return d


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def step_settings(cfg: Config, compile: bool) -> StepSettings:
    """The trainer's StepSettings for `cfg` (the same function the trainer calls)."""
    return settings_from_config(cfg, 0, compile and cfg.training.pack_documents)


def _touched_tiles(lo: np.ndarray, hi: np.ndarray, kv_len: int, tile: int) -> np.ndarray:
    """Bool [Q/tile, KV/tile]: key tiles some query of the query tile sees in [lo, hi)."""
    q = lo.shape[0]
    nq, nkv = -(-q // tile), -(-kv_len // tile)
    diff = np.zeros((nq, nkv + 1), dtype=np.int32)
    keep = hi > lo
    q_tile = (np.arange(q) // tile)[keep]
    np.add.at(diff, (q_tile, lo[keep] // tile), 1)
    np.add.at(diff, (q_tile, (hi[keep] - 1) // tile + 1), -1)
    return np.cumsum(diff, axis=1)[:, :nkv] > 0


def synthetic_pack(doc_lengths: list[int], supervised_fraction: float, pad_to: int | None) -> Pack:
    """A pack of these documents: the prompt first, the last `fraction` supervised."""
    ids = [torch.zeros(n, dtype=torch.long) for n in doc_lengths]
    masks = []
    for n in doc_lengths:
        m = torch.zeros(n, dtype=torch.bool)
        m[n - max(1, round(supervised_fraction * n)) :] = True
        masks.append(m)
    if pad_to is not None:
        return pack_documents(ids, masks, pad_to=pad_to)
    return pack_documents(ids, masks, pad_multiple=FLEX_BLOCK)


def count_pairs(
    pack: Pack, st: StepSettings, sliding_window: int | None, seed: int = 0
) -> tuple[int, float, AttentionPairs]:
    """(N, R, pairs) of one pack, with the trainer's own anchor sampling and mask rule."""
    multiple = FLEX_BLOCK // math.gcd(FLEX_BLOCK, st.block_size)
    anchors = sample_anchors(
        pack,
        st.max_anchors,
        st.block_size,
        torch.Generator().manual_seed(seed),
        pad_to=anchor_pad(st),
        pad_multiple=multiple,
    )
    iv = build_intervals(anchors, pack.length, sliding_window)
    lo_c, hi_c = iv.ctx_lo_Q.numpy().astype(np.int64), iv.ctx_hi_Q.numpy().astype(np.int64)
    lo_b, hi_b = iv.blk_lo_Q.numpy().astype(np.int64), iv.blk_hi_Q.numpy().astype(np.int64)
    visible = float((hi_c - lo_c).clip(min=0).sum() + (hi_b - lo_b).clip(min=0).sum())
    tiles = _touched_tiles(lo_c, hi_c, iv.kv_len, FLEX_BLOCK) | _touched_tiles(
        lo_b, hi_b, iv.kv_len, FLEX_BLOCK
    )
    pairs = AttentionPairs(
        dense=float(iv.q_len * iv.kv_len),
        visible=visible,
        tiles=float(tiles.sum()) * FLEX_BLOCK * FLEX_BLOCK,
    )
    return anchors.num_anchors, float(anchors.slot_valid_NB.sum()), pairs


def _replay_documents(
    stats: DataStats, cfg: Config, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray | None]:
    """(lengths, first supervised positions or None) of the documents to replay."""
    if stats.lengths is not None and len(stats.lengths):
        lengths = np.asarray(stats.lengths, dtype=np.int64)
        first = stats.first_supervised
        if len(lengths) > MAX_REPLAY_DOCS:
            # The same documents' lengths and positions (choice of an array picks these
            # indices: the sample is the one earlier versions replayed).
            picks = rng.choice(len(lengths), MAX_REPLAY_DOCS, replace=False)
            lengths = lengths[picks]
            first = None if first is None else np.asarray(first)[picks]
        return lengths, first
    # Only a mean is known: enough equal documents for several steps.
    one = int(max(2, round(stats.mean_tokens)))
    per_step = max(1, cfg.data.token_budget // min(one, cfg.data.doc_limit))
    return np.full(per_step * 4 * PAIR_SAMPLE_PACKS, one, dtype=np.int64), None


def _replay_epoch(stats: DataStats, cfg: Config) -> tuple[np.ndarray, list[list[int]]]:
    """The replayed documents' lengths and the trainer's first epoch of them, cut into steps
    (`batching.epoch_steps`, which leaves out what the trainer's epochs leave out)."""
    d = cfg.data
    lengths, first = _replay_documents(stats, cfg, np.random.default_rng(d.shuffle_seed))
    steps = epoch_steps(lengths, d.token_budget, d.doc_limit, d.shuffle_seed, 0, first)
    if not steps:
        raise DFlashError(
            f"{stats.source}: no step to plan: every document is shorter than 2 tokens or "
            f"supervises nothing within its first {d.doc_limit:,} tokens (data.max_doc_tokens / "
            "token_budget); raise data.max_doc_tokens"
        )
    return lengths, steps


def step_shape(stats: DataStats, cfg: Config, spec: DrafterSpec, compile: bool) -> StepShape:
    """Mean step shapes of `cfg` on `stats` (see the module docstring)."""
    # The fast step (training.step_path) pads every step to fixed shapes and runs the
    # target on its own row layout: count the same work it does.
    h, layers = spec.target_hidden_size, spec.num_target_hidden_layers
    fast = planned_fast(cfg, 12 * h * h * layers + 2 * spec.vocab_size * h)
    st = step_settings(cfg, compile or fast)
    d = cfg.data
    fast_rows = (
        fast_shapes(st, d.doc_limit, True, cfg.training.target_chunk_tokens) if fast else None
    )
    lengths, steps = _replay_epoch(stats, cfg)
    clipped = np.minimum(lengths, d.doc_limit)
    docs, real, padded, attn, lmax, micro = [], [], [], [], [], []
    for idx in steps:
        ls = [int(clipped[i]) for i in idx]
        docs.append(len(ls))
        real.append(sum(ls))
        if fast_rows is not None:
            if cfg.training.target_attention == "flex":
                cost = whole_pack_cost(ls, fast_rows.ctx_len)
            else:
                cost = layout_cost(ls, fast_rows)
            padded.append(cost[0])
            attn.append(cost[1])
            micro.append(cost[2])
            lmax.append(cost[3])
            continue
        groups = _micro_batches(ls, st.target_batch_tokens)
        longest = [max(ls[i] for i in g) for g in groups]
        padded.append(sum(len(g) * m for g, m in zip(groups, longest)))
        attn.append(sum(len(g) * m * m for g, m in zip(groups, longest)))
        lmax.append(float(np.mean(longest)))
        micro.append(len(groups))
    docs_per_step = float(np.mean(docs))

    windows = {
        kind: (spec.sliding_window if kind == "sliding_attention" else None)
        for kind in dict.fromkeys(spec.layer_types)
    }
    picks = np.unique(np.linspace(0, len(steps) - 1, PAIR_SAMPLE_PACKS).round().astype(int))
    ctx, anchors, rows = [], [], []
    per_kind: dict[str, list[AttentionPairs]] = {k: [] for k in windows}
    for j, i in enumerate(picks.tolist()):
        pack = synthetic_pack(
            [int(clipped[k]) for k in steps[i]], stats.supervised_fraction, st.fixed_ctx_len
        )
        for kind, window in windows.items():
            n, r, p = count_pairs(pack, st, window, seed=j)
            per_kind[kind].append(p)
        ctx.append(pack.length)
        anchors.append(n)
        rows.append(r)
    pairs = {
        kind: AttentionPairs(
            dense=float(np.mean([p.dense for p in ps])),
            visible=float(np.mean([p.visible for p in ps])),
            tiles=float(np.mean([p.tiles for p in ps])),
        )
        for kind, ps in per_kind.items()
    }
    return StepShape(
        docs=docs_per_step,
        target_tokens=float(np.mean(real)),
        target_padded_tokens=float(np.mean(padded)),
        target_max_len=float(np.mean(lmax)),
        target_micro_batches=float(np.mean(micro)),
        target_attn_pairs=float(np.mean(attn)),
        ctx_len=round(float(np.mean(ctx))),
        anchors=round(float(np.mean(anchors))),
        block_size=spec.block_size,
        rows=float(np.mean(rows)),
        pairs=pairs,
        # The replayed epoch's steps, scaled from the documents replayed to all of them:
        # the trainer's count where every document is replayed (up to MAX_REPLAY_DOCS).
        steps_per_epoch=len(steps) * stats.documents / len(lengths),
    )
