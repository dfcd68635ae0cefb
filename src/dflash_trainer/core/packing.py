"""Pack variable-length documents into one drafter sequence.

Shape legend: T = packed length (documents back to back, then padding), D = documents,
F = feature width, L = padded batch length.

The target runs on a right-padded batch (recurrent layers must never see another
document or left padding); this module strips that padding and concatenates the
documents. Every packed token carries its document id and its position *inside its
document*: positions restart at 0 for every document (a running position over the
pack would give every later document other RoPE phases than it sees at inference).
Padding tokens get document id -1, so no rule that compares document ids can ever
match them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class Pack:
    """A packed sequence of documents (all tensors on one device)."""

    input_ids_T: torch.Tensor
    """int64 token ids; padding is 0."""
    loss_mask_T: torch.Tensor
    """bool: token is supervised (assistant text); padding False."""
    document_ids_T: torch.Tensor
    """int64 index of the token's document in the pack; padding -1."""
    position_ids_T: torch.Tensor
    """int64 position inside its own document (restarts at 0); padding 0."""
    doc_starts_D: torch.Tensor
    """int64 packed index of each document's first token."""
    doc_lengths_D: torch.Tensor
    """int64 token count of each document."""

    @property
    def length(self) -> int:
        return int(self.input_ids_T.shape[0])

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.doc_lengths_D.sum())

    @property
    def num_docs(self) -> int:
        return int(self.doc_lengths_D.shape[0])

    def to(self, device: torch.device | str) -> Pack:
        return Pack(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_documents(
    input_ids: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    pad_multiple: int = 1,
    pad_to: int | None = None,
) -> Pack:
    """Concatenate documents; pad the pack to `pad_to` or up to a multiple of `pad_multiple`."""
    if len(input_ids) != len(loss_masks):
        raise ValueError(f"{len(input_ids)} documents but {len(loss_masks)} loss masks")
    if len(input_ids) == 0:
        raise ValueError("cannot pack zero documents")
    lengths = torch.tensor([int(x.numel()) for x in input_ids], dtype=torch.long)
    for i, (ids, m) in enumerate(zip(input_ids, loss_masks)):
        if ids.numel() == 0:
            raise ValueError(f"document {i} is empty")
        if m.shape != ids.shape:
            raise ValueError(
                f"document {i}: loss mask shape {tuple(m.shape)} != {tuple(ids.shape)}"
            )
    total = int(lengths.sum())
    length = _round_up(total, pad_multiple)
    if pad_to is not None:
        if pad_to < total:
            raise ValueError(f"pad_to={pad_to} is shorter than the {total} packed tokens")
        length = pad_to
    pad = length - total
    starts = torch.cumsum(lengths, 0) - lengths
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    positions = torch.arange(total) - torch.repeat_interleave(starts, lengths)
    ids = torch.cat([x.reshape(-1).long() for x in input_ids])
    mask = torch.cat([m.reshape(-1).bool() for m in loss_masks])
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        mask = torch.cat([mask, mask.new_zeros(pad)])
        doc_ids = torch.cat([doc_ids, doc_ids.new_full((pad,), -1)])
        positions = torch.cat([positions, positions.new_zeros(pad)])
    return Pack(ids, mask, doc_ids, positions, starts, lengths)
