"""The drafter's attention rule (docs/algorithm.md section 2), three ways.

Shape legend: T = packed context length (a multiple of the flex block), N = anchors,
B = block size, Q = N*B queries (block slots, anchor-major), KV = T + Q keys
(the packed context first, then every block's own slots).

For the block of anchor a, slot k (position a+k):
- full layers see context p of the same document with p < a, and all B slots of their
  own block;
- sliding layers (window W) see context p with a+k-W < p < a, and own-block slots j
  with k-W < j <= k.
Never another block, never another document.

Because documents are contiguous in the pack, each query's visible keys are exactly
two half-open index intervals: one in the context part, one in the block part. The
rule is therefore stored as four int tensors of length Q (`Intervals`), from which
we build (1) a FlexAttention `BlockMask` block-sparsely (cost O(Q * KV/128), never a
dense Q x KV grid), (2) the element-wise `mask_mod` for partial blocks, and (3) a
dense boolean mask for SDPA and for the inference step. `dense_reference` states
the rule again, independently, from document ids and positions: the tests compare
all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash_trainer.core.anchors import Anchors
from dflash_trainer.core.packing import Pack

FLEX_BLOCK = 128


@dataclass(frozen=True)
class Intervals:
    """Per query q: visible keys are [ctx_lo, ctx_hi) and [blk_lo, blk_hi) (int32, [Q])."""

    ctx_lo_Q: torch.Tensor
    ctx_hi_Q: torch.Tensor
    blk_lo_Q: torch.Tensor
    blk_hi_Q: torch.Tensor
    kv_len: int

    @property
    def q_len(self) -> int:
        return int(self.ctx_lo_Q.shape[0])


def build_intervals(anchors: Anchors, ctx_len: int, sliding_window: int | None = None) -> Intervals:
    """The visible-key intervals of every block slot; `sliding_window=None` = full layer."""
    n, b = anchors.num_anchors, anchors.block_size
    dev = anchors.anchor_idx_N.device
    k = torch.arange(b, device=dev)[None, :]
    a = anchors.anchor_idx_N[:, None]
    ctx_lo = anchors.doc_start_N[:, None].expand(n, b)
    ctx_hi = a.expand(n, b)
    blk_base = ctx_len + torch.arange(n, device=dev)[:, None] * b
    blk_lo = blk_base.expand(n, b)
    blk_hi = (blk_base + b).expand(n, b)
    if sliding_window is not None:
        w = sliding_window
        ctx_lo = torch.maximum(ctx_lo, a + k - w + 1)
        blk_lo = blk_base + (k - w + 1).clamp(min=0)
        blk_hi = blk_base + k + 1
    # Padding anchors (and empty windows) get an empty context interval.
    ctx_hi = torch.maximum(ctx_hi, ctx_lo)
    pad = ~anchors.real_N[:, None].expand(n, b)
    ctx_lo = torch.where(pad, torch.zeros_like(ctx_lo), ctx_lo)
    ctx_hi = torch.where(pad, torch.zeros_like(ctx_hi), ctx_hi)

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1).to(torch.int32).contiguous()

    return Intervals(flat(ctx_lo), flat(ctx_hi), flat(blk_lo), flat(blk_hi), ctx_len + n * b)


def intervals_to_dense(iv: Intervals) -> torch.Tensor:
    """Bool [Q, KV] from the intervals (tests, SDPA path on small problems)."""
    kv = torch.arange(iv.kv_len, device=iv.ctx_lo_Q.device)[None, :]
    in_ctx = (kv >= iv.ctx_lo_Q[:, None]) & (kv < iv.ctx_hi_Q[:, None])
    in_blk = (kv >= iv.blk_lo_Q[:, None]) & (kv < iv.blk_hi_Q[:, None])
    return in_ctx | in_blk


def dense_reference(
    pack: Pack, anchors: Anchors, ctx_len: int, sliding_window: int | None = None
) -> torch.Tensor:
    """Bool [Q, KV] written directly from the spec's rule with document ids and positions."""
    n, b = anchors.num_anchors, anchors.block_size
    doc = torch.full((ctx_len,), -1, dtype=torch.long)
    pos = torch.zeros(ctx_len, dtype=torch.long)
    doc[: pack.length] = pack.document_ids_T.cpu()
    pos[: pack.length] = pack.position_ids_T.cpu()
    a_idx = anchors.anchor_idx_N.cpu()
    real = anchors.real_N.cpu()
    out = torch.zeros(n * b, ctx_len + n * b, dtype=torch.bool)
    for i in range(n):
        a_doc = doc[a_idx[i]]
        a_pos = pos[a_idx[i]]
        for k in range(b):
            q = i * b + k
            if real[i]:
                ctx_ok = (doc == a_doc) & (doc >= 0) & (pos < a_pos)
                if sliding_window is not None:
                    ctx_ok &= pos > a_pos + k - sliding_window
                out[q, :ctx_len] = ctx_ok
            for j in range(b):
                ok = True if sliding_window is None else (k - sliding_window < j <= k)
                out[q, ctx_len + i * b + j] = ok
    return out


def _block_tables(iv: Intervals, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, full) bool [Q/block, KV/block]: a key block is touched / entirely visible."""
    q, kv = iv.q_len, iv.kv_len
    assert q % block == 0 and kv % block == 0, "pad Q and KV to the flex block size"
    dev = iv.ctx_lo_Q.device
    s = (torch.arange(kv // block, device=dev) * block)[None, :]
    e = s + block

    def one(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = lo[:, None].long(), hi[:, None].long()
        touch = (lo < e) & (hi > s) & (lo < hi)
        cover = (lo <= s) & (hi >= e)
        return touch, cover

    t1, c1 = one(iv.ctx_lo_Q, iv.ctx_hi_Q)
    t2, c2 = one(iv.blk_lo_Q, iv.blk_hi_Q)
    nq = q // block
    touch = (t1 | t2).view(nq, block, -1).any(1)
    # A key block lies in one part (context or blocks): covering in either part suffices.
    full = (c1 | c2).view(nq, block, -1).all(1)
    return touch, full


def _to_indices(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [nq, nkv] -> (num [1,1,nq] int32, indices [1,1,nq,nkv] int32, selected first)."""
    num = table.sum(-1).to(torch.int32)
    order = torch.argsort((~table).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None], order[None, None].contiguous()


def make_mask_mod(iv: Intervals) -> Callable[..., torch.Tensor]:
    """FlexAttention mask_mod for partial blocks: the two-interval rule per query."""
    ctx_lo, ctx_hi, blk_lo, blk_hi = iv.ctx_lo_Q, iv.ctx_hi_Q, iv.blk_lo_Q, iv.blk_hi_Q

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        in_ctx = (kv_idx >= ctx_lo[q_idx]) & (kv_idx < ctx_hi[q_idx])
        in_blk = (kv_idx >= blk_lo[q_idx]) & (kv_idx < blk_hi[q_idx])
        return in_ctx | in_blk

    return mask_mod


def build_block_mask(iv: Intervals, block: int = FLEX_BLOCK) -> Any:
    """Block-sparse FlexAttention BlockMask built from the intervals."""
    from torch.nn.attention.flex_attention import BlockMask

    touch, full = _block_tables(iv, block)
    partial = touch & ~full
    kv_num, kv_idx = _to_indices(partial)
    full_num, full_idx = _to_indices(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block,
        mask_mod=make_mask_mod(iv),
        seq_lengths=(iv.q_len, iv.kv_len),
    )


def inference_mask(
    ctx_len: int | torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    device: torch.device | str,
    columns: int | None = None,
) -> torch.Tensor:
    """Bool [B, C + B] for one block whose anchor follows `ctx_len` cached positions.

    The cached context holds positions 0..a-1 of the current document (a = ctx_len). C is
    `columns` (default ctx_len): a fixed-size cache (static_decode.py) passes its capacity and
    the anchor as a 0-d tensor, and the columns at or past the anchor are masked.
    """
    cols = int(ctx_len) if columns is None else columns
    k = torch.arange(block_size, device=device)[:, None]
    p = torch.arange(cols, device=device)[None, :]
    j = torch.arange(block_size, device=device)[None, :]
    ctx_ok = (p < ctx_len).expand(block_size, cols)
    if sliding_window is None:
        blk_ok = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    else:
        ctx_ok = ctx_ok & (p > ctx_len + k - sliding_window)
        blk_ok = (j > k - sliding_window) & (j <= k)
    return torch.cat([ctx_ok, blk_ok], dim=1)
