"""Host side of the fast step: fixed shapes, and every index a step needs, prepared ahead.

Shape legend: T = packed length (fixed), N = anchors (fixed), B = block size,
Q = N*B block slots, R = rows of a target chunk, L = a row's length (a bucket).

The fast step (fast_step.py) never lets the host wait for the GPU, so everything that
decides a shape or an index is computed here, on the CPU, from the documents alone:
the pack, the anchors (the same sampler and seed as the standard step, so the same
anchors), the block inputs, the attention intervals, and the target's row layout.

Target layout. The standard step gives every document its own right-padded row. Here a
document opens a row of the shortest bucket that holds it (128, 256, ... up to the
document limit), and when the target's layers are all full attention, several documents
share a row (best fit, longest first, into rows of any bucket; ~99% of the row tokens
are real on ShareGPT-like lengths): a block-diagonal mask with per-document positions
keeps each one from seeing the others, so its features are those of its own row. Rows of one bucket are cut into chunks of a fixed `chunk_tokens / L` rows (the last
one rounded up to a halving), and each chunk shape (R, L) is one CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflash_trainer.config import Config
from dflash_trainer.core.anchors import (
    block_input_ids,
    block_position_ids,
    data_labels,
    sample_anchors,
)
from dflash_trainer.core.loss import decay_slot_weights
from dflash_trainer.core.masks import FLEX_BLOCK, build_intervals
from dflash_trainer.core.packing import Pack, pack_documents
from dflash_trainer.train.step import StepSettings, anchor_pad

AUTO_MAX_TARGET_PARAMS = 2e9
"""auto picks the fast step under this many target parameters: above it a step is
compute-bound (the 27B target: ~1 s of GPU per step) and launch overhead is noise."""
ROW_MIN = 128
CHUNK_STEPS = 8
"""A bucket's last chunk is padded to the next eighth of a full chunk (at most 1/8 wasted)."""
"""Shortest row bucket."""
CHUNK_TOKENS = 16384
"""Rows x length of one full target chunk: big enough that a 135M target's chunk is a few
milliseconds of GPU work, small enough that the block-diagonal mask stays ~64 MB."""


@dataclass(frozen=True)
class FastShapes:
    """The fixed shapes of a fast step."""

    ctx_len: int
    """T: every pack is padded to this (the token budget, rounded to the flex block)."""
    anchors: int
    """N: anchors padded to this count (zero-weight padding anchors)."""
    row_lengths: tuple[int, ...]
    """Target row-length buckets, ascending."""
    chunk_tokens: int
    """Rows x length of a full chunk (a multiple of every bucket)."""
    multi_doc_rows: bool
    """Several documents share a target row (full-attention targets only)."""

    def chunk_row_counts(self, length: int) -> list[int]:
        """Row counts a chunk of bucket `length` may have: multiples of an eighth of the full
        count, and powers of two below that (each count is one graph)."""
        full = self.chunk_tokens // length
        step = max(1, full // CHUNK_STEPS)
        small = {2**k for k in range(step.bit_length()) if 2**k < step}
        return sorted(small | set(range(step, full + 1, step)) | {full})

    def split_rows(self, n_rows: int, length: int) -> list[tuple[int, int]]:
        """(rows taken, chunk rows) per chunk for `n_rows` rows of bucket `length`."""
        counts = self.chunk_row_counts(length)
        out = []
        while n_rows > 0:
            take = min(n_rows, counts[-1])
            out.append((take, min(c for c in counts if c >= take)))
            n_rows -= take
        return out


def fast_shapes(
    st: StepSettings, doc_limit: int, multi_doc_rows: bool, chunk_tokens: int = CHUNK_TOKENS
) -> FastShapes:
    if st.fixed_ctx_len is None or not st.fixed_anchors:
        raise ValueError("the fast step needs fixed shapes (settings_for_spec(..., True))")
    n = anchor_pad(st)
    assert n is not None
    top = -(-doc_limit // ROW_MIN) * ROW_MIN
    lengths = [top]
    while lengths[-1] > ROW_MIN:
        lengths.append(max(ROW_MIN, -(-(lengths[-1] // 2) // ROW_MIN) * ROW_MIN))
    chunk = -(-max(chunk_tokens, top) // top) * top
    return FastShapes(st.fixed_ctx_len, n, tuple(sorted(set(lengths))), chunk, multi_doc_rows)


@dataclass
class Row:
    length: int
    docs: list[tuple[int, int]] = field(default_factory=list)
    """(document index, offset in the row)."""
    used: int = 0


def layout_rows(lengths: Sequence[int], shapes: FastShapes) -> list[Row]:
    """Documents into rows, longest first: into the open row it fills best (any bucket: a
    row costs the same however full), else a new row of the shortest bucket that holds it."""
    rows: list[Row] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        row = None
        if shapes.multi_doc_rows:
            fits = [r for r in rows if r.used + n <= r.length]
            row = min(fits, key=lambda r: r.length - r.used, default=None)
        if row is None:
            length = min((b for b in shapes.row_lengths if b >= n), default=None)
            if length is None:
                raise ValueError(
                    f"a {n}-token document exceeds the longest row {shapes.row_lengths}"
                )
            row = Row(length)
            rows.append(row)
        row.docs.append((i, row.used))
        row.used += n
    return sorted(rows, key=lambda r: r.length)


@dataclass
class TargetChunk:
    """One fixed-shape target forward: [R, L] inputs and where each token lands in the pack."""

    ids_RL: torch.Tensor
    pos_RL: torch.Tensor
    """Position inside the token's own document (0 for padding)."""
    seg_RL: torch.Tensor
    """Document index of the token (-1 for padding): the block-diagonal mask."""
    dst_RL: torch.Tensor
    """Packed index of the token; padding points at row T of the output (a dump row)."""

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.ids_RL.shape[0]), int(self.ids_RL.shape[1])


def build_chunks(
    rows: list[Row], ids: Sequence[torch.Tensor], starts: Sequence[int], shapes: FastShapes
) -> list[TargetChunk]:
    end = max((starts[d] + int(ids[d].numel()) for row in rows for d, _ in row.docs), default=0)
    if end > shapes.ctx_len:  # on the GPU this would be an index assert inside a graph
        raise ValueError(f"documents end at token {end}, past the pack of {shapes.ctx_len}")
    out: list[TargetChunk] = []
    for length in shapes.row_lengths:
        group = [r for r in rows if r.length == length]
        for take, n_rows in shapes.split_rows(len(group), length):
            part, group = group[:take], group[take:]
            ch = TargetChunk(
                ids_RL=torch.zeros(n_rows, length, dtype=torch.long),
                pos_RL=torch.zeros(n_rows, length, dtype=torch.long),
                seg_RL=torch.full((n_rows, length), -1, dtype=torch.long),
                dst_RL=torch.full((n_rows, length), shapes.ctx_len, dtype=torch.long),
            )
            for r, row in enumerate(part):
                for d, off in row.docs:
                    n = int(ids[d].numel())
                    ch.ids_RL[r, off : off + n] = ids[d]
                    ch.pos_RL[r, off : off + n] = torch.arange(n)
                    ch.seg_RL[r, off : off + n] = d
                    ch.dst_RL[r, off : off + n] = starts[d] + torch.arange(n)
            out.append(ch)
    return out


@dataclass
class HostStep:
    """Everything one fast micro-step needs, on the host (pinned when the GPU is used)."""

    index: int
    tokens: int
    truncated: int
    chunks: list[TargetChunk]
    ctx_pos_T: torch.Tensor
    block_ids_NB: torch.Tensor
    block_pos_NB: torch.Tensor
    valid_NB: torch.Tensor
    real_N: torch.Tensor
    pred_idx_NB: torch.Tensor
    data_labels_NB: torch.Tensor | None
    intervals: dict[str, tuple[torch.Tensor, ...]]
    """Per layer kind: (ctx_lo, ctx_hi, blk_lo, blk_hi), int32 [Q]."""
    unit_weight: float | None
    """sum(w * valid) with decay weights (None for dpace): the step's share of the loss."""

    def pin(self) -> HostStep:
        def p(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory()

        for ch in self.chunks:
            ch.ids_RL, ch.pos_RL, ch.seg_RL, ch.dst_RL = map(
                p, (ch.ids_RL, ch.pos_RL, ch.seg_RL, ch.dst_RL)
            )
        for name in ("ctx_pos_T", "block_ids_NB", "block_pos_NB", "valid_NB", "real_N"):
            setattr(self, name, p(getattr(self, name)))
        self.pred_idx_NB = p(self.pred_idx_NB)
        if self.data_labels_NB is not None:
            self.data_labels_NB = p(self.data_labels_NB)
        self.intervals = {k: tuple(map(p, v)) for k, v in self.intervals.items()}
        return self


def pack_chunk(pack: Pack) -> TargetChunk:
    """The whole pack as one [1, T] target input (flex target attention: no rows needed)."""
    seg = pack.document_ids_T
    dst = torch.where(seg >= 0, torch.arange(seg.numel()), seg.numel())
    return TargetChunk(pack.input_ids_T[None], pack.position_ids_T[None], seg[None], dst[None])


def prepare_host(
    index: int,
    docs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    truncated: int,
    st: StepSettings,
    shapes: FastShapes,
    windows: dict[str, int | None],
    generator: torch.Generator,
    whole_pack: bool = False,
) -> HostStep:
    """The host half of micro-step `index` (`windows`: layer kind -> sliding window); with
    `whole_pack` the target runs the pack as one sequence (`pack_chunk`), else in rows."""
    ids = [d[0] for d in docs]
    pack = pack_documents(ids, [d[1] for d in docs], pad_to=shapes.ctx_len)
    multiple = FLEX_BLOCK // math.gcd(FLEX_BLOCK, st.block_size)
    anchors = sample_anchors(
        pack, st.max_anchors, st.block_size, generator, pad_to=shapes.anchors, pad_multiple=multiple
    )
    intervals: dict[str, tuple[torch.Tensor, ...]] = {}
    for kind, window in windows.items():
        iv = build_intervals(anchors, shapes.ctx_len, window)
        intervals[kind] = (iv.ctx_lo_Q, iv.ctx_hi_Q, iv.blk_lo_Q, iv.blk_hi_Q)
    valid = anchors.slot_valid_NB
    unit_weight = None
    if st.weighting == "decay":
        unit_weight = float(decay_slot_weights(valid, st.gamma).sum())
    if whole_pack:
        chunks = [pack_chunk(pack)]
    else:
        rows = layout_rows([int(x.numel()) for x in ids], shapes)
        chunks = build_chunks(rows, ids, pack.doc_starts_D.tolist(), shapes)
    return HostStep(
        index=index,
        tokens=pack.num_tokens,
        truncated=truncated,
        chunks=chunks,
        ctx_pos_T=pack.position_ids_T,
        block_ids_NB=block_input_ids(anchors, pack.input_ids_T, st.mask_token_id),
        block_pos_NB=block_position_ids(anchors),
        valid_NB=valid,
        real_N=anchors.real_N,
        pred_idx_NB=anchors.pred_idx_NB(),
        data_labels_NB=data_labels(anchors, pack.input_ids_T) if st.labels == "data" else None,
        intervals=intervals,
        unit_weight=unit_weight,
    )


def layout_cost(lengths: Sequence[int], shapes: FastShapes) -> tuple[int, int, int, float]:
    """(padded tokens, attention pairs, chunks, mean row length) of one step's target (planner)."""
    rows = layout_rows(lengths, shapes)
    padded = pairs = chunks = 0
    row_len = []
    for length in shapes.row_lengths:
        n = sum(1 for r in rows if r.length == length)
        for _, r in shapes.split_rows(n, length):
            padded += r * length
            pairs += r * length * length
            chunks += 1
            row_len.append(length)
    return padded, pairs, chunks, float(sum(row_len) / max(1, len(row_len)))


def whole_pack_cost(lengths: Sequence[int], ctx_len: int) -> tuple[int, int, int, float]:
    """`layout_cost` for the flex target (`pack_chunk`): the pack is one sequence and each
    128-token query block attends to the key blocks from its first document's start to
    itself, whole tiles (what a block-sparse kernel computes)."""
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    blocks = ctx_len // FLEX_BLOCK
    first = list(range(blocks))  # padding queries see themselves: their own block
    for start, n in zip(starts, lengths):
        for qb in range(start // FLEX_BLOCK, min(blocks, -(-(start + n) // FLEX_BLOCK))):
            first[qb] = min(first[qb], start // FLEX_BLOCK)
    tiles = sum(qb - f + 1 for qb, f in enumerate(first))
    return ctx_len, tiles * FLEX_BLOCK * FLEX_BLOCK, 1, float(ctx_len)


def planned_fast(cfg: Config, target_params: float) -> bool:
    """Whether a run of `cfg` on a GPU takes the fast step (the planner's view of auto)."""
    t = cfg.training
    if t.step_path != "auto":
        return t.step_path == "fast"
    return (
        t.pack_documents
        and cfg.distributed.placement == "colocated"
        and target_params < AUTO_MAX_TARGET_PARAMS
    )
