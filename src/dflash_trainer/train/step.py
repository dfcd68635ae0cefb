"""One training step, top to bottom (docs/algorithm.md section 3).

    documents -> target forward (no grad, right-padded, taps)     `run_target`
              -> pack + anchors + labels                           `prepare_blocks`
              -> drafter forward over all blocks + loss            `drafter_loss`

The three stages are separate functions so the `pairs` placement can run the target
stage of step i+1 on one GPU while the drafter stage of step i runs on another, and
so benchmarks can time them apart. Nothing here owns an optimizer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_trainer.config import Config
from dflash_trainer.core.anchors import (
    Anchors,
    block_input_ids,
    block_position_ids,
    data_labels,
    sample_anchors,
)
from dflash_trainer.core.drafter import DFlashDrafter, sdpa_attention
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.core.loss import DFlash2Inputs, LossResult, Objective, dflash_loss
from dflash_trainer.core.masks import (
    FLEX_BLOCK,
    build_block_mask,
    build_intervals,
    intervals_to_dense,
)
from dflash_trainer.core.packing import Pack, pack_documents
from dflash_trainer.target.model import FrozenTarget
from dflash_trainer.train.distributed import unwrap


@dataclass(frozen=True)
class StepSettings:
    block_size: int
    mask_token_id: int
    max_anchors: int
    labels: str  # target | data
    loss: str  # ce | kl
    weighting: str
    gamma: float
    dpace_alpha: float
    chunk_rows: int
    fixed_ctx_len: int | None = None
    """Pad every pack to this length (fixed shapes for torch.compile); None: next multiple of 128."""
    fixed_anchors: bool = False
    """Pad anchors to a fixed count (fixed shapes for torch.compile)."""
    target_batch_tokens: int = 16384
    """Padded tokens (rows x longest) per target micro-batch."""
    lk_weight: float = 0.0
    selector_weight: float = 1.0
    top_k: int = 0
    """DFlash2: candidates per slot for the selector term (0: DFlash)."""

    @property
    def target_distribution(self) -> bool:
        """The loss reads the target's whole distribution (its final hidden states)."""
        return self.labels == "target" and (self.loss in ("kl", "lk") or self.lk_weight > 0)

    def objective(self) -> Objective:
        return Objective(
            loss=self.loss,
            weighting=self.weighting,
            gamma=self.gamma,
            dpace_alpha=self.dpace_alpha,
            chunk_rows=self.chunk_rows,
            lk_weight=self.lk_weight,
            selector_weight=self.selector_weight,
            top_k=self.top_k,
        )


def settings_for_spec(cfg: Config, spec: DrafterSpec, fixed_shapes: bool) -> StepSettings:
    """The trainer's step settings: block size, mask token and kind read from the drafter spec."""
    st = _settings(cfg, spec.block_size, spec.mask_token_id, fixed_shapes)
    return dataclasses.replace(st, top_k=spec.selector_top_k if spec.is_dflash2 else 0)


def settings_from_config(cfg: Config, mask_token_id: int, fixed_shapes: bool) -> StepSettings:
    """The step settings of a run before its drafter spec is resolved (the planner's replay).

    The spec's block size is the config's (core/geometry.py), so this equals
    `settings_for_spec` of the resolved spec.
    """
    st = _settings(cfg, cfg.drafter.block_size, mask_token_id, fixed_shapes)
    dflash2 = cfg.drafter.kind == "dflash2"
    return dataclasses.replace(st, top_k=cfg.drafter.selector_top_k if dflash2 else 0)


def _settings(cfg: Config, block_size: int, mask_token_id: int, fixed_shapes: bool) -> StepSettings:
    """Fixed shapes (pack padded to the budget, anchors to max_anchors) keep torch.compile
    to one graph; without compile, or for the unpacked baseline, shapes follow the data.
    """
    t, d = cfg.training, cfg.data
    return StepSettings(
        block_size=block_size,
        mask_token_id=mask_token_id,
        max_anchors=t.max_anchors,
        labels=t.labels,
        loss=t.loss,
        weighting=t.weighting,
        gamma=t.resolved_gamma(block_size),
        dpace_alpha=t.dpace_alpha,
        chunk_rows=t.loss_chunk_rows,
        fixed_ctx_len=-(-d.token_budget // FLEX_BLOCK) * FLEX_BLOCK if fixed_shapes else None,
        fixed_anchors=fixed_shapes,
        target_batch_tokens=max(d.token_budget, 2 * d.doc_limit),
        lk_weight=t.lk_weight,
        selector_weight=t.selector_loss_weight,
    )


@dataclass
class TargetOut:
    """Packed target outputs of one step, on the target's device."""

    pack: Pack
    features_TF: torch.Tensor
    final_hidden_TH: torch.Tensor | None


@dataclass
class Blocks:
    """Everything the drafter stage needs, on the drafter's device."""

    pack: Pack
    anchors: Anchors
    features_TF: torch.Tensor
    block_ids_NB: torch.Tensor
    labels_NB: torch.Tensor | None
    target_hidden_NBH: torch.Tensor | None


def _micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group documents (sorted by length) so rows x longest stays within budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > budget:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def run_target(
    target: FrozenTarget,
    docs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    st: StepSettings,
) -> TargetOut:
    """Target forward over the step's documents (each (input_ids, loss_mask), truncated)."""
    ids = [d[0] for d in docs]
    masks = [d[1] for d in docs]
    need_final = st.labels == "target"
    lengths = [int(x.numel()) for x in ids]
    feats: list[torch.Tensor | None] = [None] * len(ids)
    finals: list[torch.Tensor | None] = [None] * len(ids)
    groups = _micro_batches(lengths, st.target_batch_tokens)
    # A sharded target's forward is a collective, and ranks' documents group into
    # different numbers of micro-batches: ranks with fewer pad with one-token forwards.
    # (One forward over all documents would also keep ranks in step, but would pad every
    # row to the longest document, the memory the micro-batches exist to bound.)
    for _ in range(target.forward_calls(len(groups)) - len(groups)):
        target.idle_forward()
    for group in groups:
        out = target.forward_documents([ids[i] for i in group], need_final=need_final)
        start = 0
        for i in group:
            n = lengths[i]
            feats[i] = out.features_TF[start : start + n]
            if out.final_hidden_TH is not None:
                finals[i] = out.final_hidden_TH[start : start + n]
            start += n
    total = sum(lengths)
    if st.fixed_ctx_len is not None:
        pad_to = st.fixed_ctx_len
        if total > pad_to:
            raise ValueError(f"{total} tokens exceed the fixed pack length {pad_to}")
        pack = pack_documents(ids, masks, pad_to=pad_to)
    else:
        pack = pack_documents(ids, masks, pad_multiple=FLEX_BLOCK)
    pad = pack.length - total
    f = torch.cat([t for t in feats if t is not None], 0)
    features = torch.cat([f, f.new_zeros(pad, f.shape[1])], 0) if pad else f
    final = None
    if need_final:
        h = torch.cat([t for t in finals if t is not None], 0)
        final = torch.cat([h, h.new_zeros(pad, h.shape[1])], 0) if pad else h
    return TargetOut(pack.to(features.device), features, final)


def anchor_pad(st: StepSettings) -> int | None:
    """Fixed anchor count: max_anchors rounded so N*B is a multiple of the flex block."""
    if not st.fixed_anchors:
        return None
    q = -(-st.max_anchors * st.block_size // FLEX_BLOCK) * FLEX_BLOCK
    return -(-q // st.block_size)


def prepare_blocks(
    tout: TargetOut,
    target: FrozenTarget,
    st: StepSettings,
    generator: torch.Generator,
    device: torch.device,
) -> Blocks:
    """Sample anchors, build block inputs and labels; move to the drafter's device."""
    pack = tout.pack
    # FlexAttention needs N*B to be a multiple of its block: pad the anchor count up.
    multiple = FLEX_BLOCK // math.gcd(FLEX_BLOCK, st.block_size)
    anchors = sample_anchors(
        pack, st.max_anchors, st.block_size, generator, pad_to=anchor_pad(st), pad_multiple=multiple
    )
    labels = target_hidden = None
    valid = anchors.slot_valid_NB
    if st.labels == "data":
        labels = data_labels(anchors, pack.input_ids_T)
    else:
        assert tout.final_hidden_TH is not None
        pred_idx = anchors.pred_idx_NB()
        if st.target_distribution:
            target_hidden = tout.final_hidden_TH[pred_idx]
        else:
            labels = torch.zeros_like(pred_idx)
            labels[valid] = target.argmax_at(tout.final_hidden_TH[pred_idx[valid]])
    block_ids = block_input_ids(anchors, pack.input_ids_T, st.mask_token_id)
    return Blocks(
        pack=pack.to(device),
        anchors=anchors.to(device),
        features_TF=tout.features_TF.to(device, non_blocking=True),
        block_ids_NB=block_ids.to(device),
        labels_NB=labels.to(device) if labels is not None else None,
        target_hidden_NBH=target_hidden.to(device) if target_hidden is not None else None,
    )


def build_masks(blocks: Blocks, spec: DrafterSpec, use_flex: bool) -> dict[str, Any]:
    """One mask per layer type in use: block-sparse BlockMask (flex) or dense bool (sdpa)."""
    out: dict[str, Any] = {}
    for kind in set(spec.layer_types):
        window = spec.sliding_window if kind == "sliding_attention" else None
        iv = build_intervals(blocks.anchors, blocks.pack.length, window)
        out[kind] = build_block_mask(iv) if use_flex else intervals_to_dense(iv)
    return out


def drafter_loss(
    drafter: nn.Module,
    blocks: Blocks,
    embed: Callable[[torch.Tensor], torch.Tensor],
    lm_head_weight: torch.Tensor,
    st: StepSettings,
    attn_fn: Callable[..., torch.Tensor] = sdpa_attention,
    use_flex: bool = False,
    autocast_dtype: torch.dtype | None = None,
) -> LossResult:
    """Drafter forward over all blocks at once, then the chunked loss.

    `drafter` may be wrapped (DDP/FSDP): its spec is read from the inner module.
    """
    an = blocks.anchors
    inner = unwrap(drafter)
    assert isinstance(inner, DFlashDrafter)
    selector = inner.candidate_selector
    masks = build_masks(blocks, inner.spec, use_flex)
    emb = embed(blocks.block_ids_NB.reshape(-1)).detach()
    pos = block_position_ids(an).reshape(-1)
    dev = blocks.features_TF.device
    ctx = (
        torch.autocast(dev.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else torch.autocast(dev.type, enabled=False)
    )
    with ctx:
        feats = blocks.features_TF if autocast_dtype is not None else blocks.features_TF.float()
        if autocast_dtype is None:
            emb = emb.float()
        hidden = drafter(feats, blocks.pack.position_ids_T, emb, pos, masks, attn_fn)
        hidden = hidden.view(an.num_anchors, an.block_size, -1)
        d2 = None
        if selector is not None:
            d2 = DFlash2Inputs(selector, blocks.block_ids_NB[:, 0], hidden)
        return dflash_loss(
            hidden,
            lm_head_weight,
            an.slot_valid_NB,
            an.real_N,
            labels_NB=blocks.labels_NB,
            target_hidden_NBH=blocks.target_hidden_NBH,
            objective=st.objective(),
            dflash2=d2,
        )
