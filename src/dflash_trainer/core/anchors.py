"""Anchors, block inputs and slot labels over a packed sequence (docs/algorithm.md section 3).

Shape legend: T = packed length, N = anchors (possibly padded to a fixed count),
B = block size. Slot k of anchor n sits at packed index `anchor_idx_N[n] + k`.

An anchor a is eligible when a+1 is inside a's document and supervised: then the
block has at least one slot with a loss. Anchors are sampled uniformly without
replacement over all eligible positions of the pack, so documents get anchors in
proportion to their supervised tokens. A slot whose position runs past its
document's end, or lands on an unsupervised token, has no loss; its label index is
clamped inside the document so that nothing (labels, target logits, features) is
ever read from the next document: a block near a document's end would otherwise be
trained to predict the start of an unrelated document.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from dflash_trainer.core.packing import Pack


@dataclass(frozen=True)
class Anchors:
    """Sampled anchors of one pack; rows >= num_real are padding (no loss, no context)."""

    anchor_idx_N: torch.Tensor
    """int64 packed index of each anchor token."""
    anchor_pos_N: torch.Tensor
    """int64 position of the anchor inside its document."""
    doc_start_N: torch.Tensor
    """int64 packed index where the anchor's document starts."""
    doc_end_N: torch.Tensor
    """int64 packed index one past the anchor's document's last token."""
    slot_valid_NB: torch.Tensor
    """bool: slot k >= 1 inside the document and supervised (carries loss)."""
    slot_idx_NB: torch.Tensor
    """int64 packed index a+k, clamped to the document (safe to gather with)."""
    num_real: int
    """Sampled anchors; the rest is padding to a fixed N."""

    @property
    def num_anchors(self) -> int:
        return int(self.anchor_idx_N.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.slot_valid_NB.shape[1])

    @property
    def real_N(self) -> torch.Tensor:
        return torch.arange(self.num_anchors, device=self.anchor_idx_N.device) < self.num_real

    def pred_idx_NB(self) -> torch.Tensor:
        """Packed index whose target logits predict slot k (a+k-1), clamped like slot_idx."""
        return torch.maximum(self.slot_idx_NB - 1, self.doc_start_N[:, None])

    def to(self, device: torch.device | str) -> Anchors:
        moved = {
            f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "num_real"
        }
        return Anchors(**moved, num_real=self.num_real)


def eligible_anchors(pack: Pack) -> torch.Tensor:
    """Bool [T]: a+1 is in a's document and supervised."""
    doc = pack.document_ids_T
    same_doc_next = torch.zeros_like(pack.loss_mask_T)
    same_doc_next[:-1] = (doc[1:] == doc[:-1]) & (doc[:-1] >= 0)
    next_supervised = torch.zeros_like(pack.loss_mask_T)
    next_supervised[:-1] = pack.loss_mask_T[1:]
    return same_doc_next & next_supervised


def sample_anchors(
    pack: Pack,
    max_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
    pad_to: int | None = None,
    pad_multiple: int = 1,
) -> Anchors:
    """Uniform sample (without replacement) of up to max_anchors eligible anchors, sorted.

    Sorting keeps anchors of one document adjacent, which keeps the attention mask
    block-sparse. `pad_to` pads N with inert rows (fixed shapes for torch.compile);
    `pad_multiple` pads N up to a multiple (FlexAttention needs N*B % 128 == 0).
    """
    cpu = pack.to("cpu")
    eligible = torch.nonzero(eligible_anchors(cpu), as_tuple=False).flatten()
    if eligible.numel() > max_anchors:
        pick = torch.randperm(eligible.numel(), generator=generator)[:max_anchors]
        eligible = eligible[pick].sort().values
    n_real = int(eligible.numel())
    n = n_real if pad_to is None else max(pad_to, n_real)
    n = -(-max(n, 1) // pad_multiple) * pad_multiple
    if pad_to is not None and n_real > pad_to:
        raise ValueError(f"{n_real} anchors do not fit pad_to={pad_to}")

    anchor = torch.zeros(n, dtype=torch.long)
    anchor[:n_real] = eligible
    doc = cpu.document_ids_T[anchor].clamp(min=0)
    start = cpu.doc_starts_D[doc]
    end = start + cpu.doc_lengths_D[doc]
    k = torch.arange(block_size)
    idx = anchor[:, None] + k[None, :]
    inside = idx < end[:, None]
    safe_idx = torch.minimum(idx, end[:, None] - 1)
    valid = inside & cpu.loss_mask_T[safe_idx] & (k[None, :] >= 1)
    if n > n_real:
        # Padding rows: an empty document at index 0 and no valid slots.
        valid[n_real:] = False
        start[n_real:] = 0
        end[n_real:] = 0
        safe_idx[n_real:] = 0
    pos = cpu.position_ids_T[anchor]
    pos[n_real:] = 0
    out = Anchors(
        anchor_idx_N=anchor,
        anchor_pos_N=pos,
        doc_start_N=start,
        doc_end_N=end,
        slot_valid_NB=valid,
        slot_idx_NB=safe_idx,
        num_real=n_real,
    )
    return out.to(pack.input_ids_T.device)


def block_input_ids(
    anchors: Anchors, input_ids_T: torch.Tensor, mask_token_id: int
) -> torch.Tensor:
    """[N, B] block tokens: the anchor's own token, then B-1 mask tokens."""
    ids = torch.full(
        (anchors.num_anchors, anchors.block_size),
        mask_token_id,
        dtype=torch.long,
        device=input_ids_T.device,
    )
    ids[:, 0] = input_ids_T[anchors.anchor_idx_N]
    return ids


def block_position_ids(anchors: Anchors) -> torch.Tensor:
    """[N, B] positions a+k inside the anchor's document (may run past its end)."""
    k = torch.arange(anchors.block_size, device=anchors.anchor_pos_N.device)
    return anchors.anchor_pos_N[:, None] + k[None, :]


def data_labels(anchors: Anchors, input_ids_T: torch.Tensor) -> torch.Tensor:
    """[N, B] dataset token at a+k (meaningful where slot_valid_NB)."""
    return input_ids_T[anchors.slot_idx_NB]
