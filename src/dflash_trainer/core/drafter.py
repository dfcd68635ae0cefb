"""The DFlash drafter (docs/algorithm.md section 1).

Shape legend: T = context tokens, F = n_tapped * H_target, H = hidden size,
Q = block-slot queries (N blocks x B slots in training, B at inference),
Hq / Hkv = query / key-value heads, D = head dim.

    ctx = hidden_norm(fc(features))                     [T, H], once per forward
    for each layer:
        x  = input_layernorm(h)
        q  = rope(q_norm(q_proj(x)))                     block slots only
        k  = rope(k_norm(k_proj(cat(ctx, x))))           context injected in EVERY layer,
        v  = v_proj(cat(ctx, x))                         with that layer's own k/v weights
        h  = h + o_proj(attn(q, k, v, mask))
        h  = h + mlp(post_attention_layernorm(h))
    return norm(h)                                       logits = target lm_head(norm(h))

The context never passes through q_proj, o_proj or the MLP. Embeddings and lm_head
are the target's (frozen, not in this module's state dict): the caller embeds the
block tokens and applies lm_head, so the loss can chunk it.

Two entry points share every layer's math: `forward` (training: all blocks of a pack
at once, FlexAttention BlockMask or a dense mask) and `step` (inference: one block
against a per-layer cache of the context's projected K/V, which the speculative loop
extends with each accepted token's features). Because keys of the context depend
only on `ctx`, the cache holds them after k_norm and RoPE, so a step never
recomputes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.core.dflash2 import CandidateSelector, GroupedDynamicConv
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.core.masks import inference_mask

AttentionFn = Callable[..., torch.Tensor]
"""attn(q [1,Hq,Q,D], k [1,Hkv,KV,D], v [1,Hkv,KV,D], mask) -> [1,Hq,Q,D]."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 variance underflows), cast back like HF's Qwen3RMSNorm.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Rotary(nn.Module):
    """Standard (non-interleaved, rotate-half) RoPE, as Qwen3 / z-lab."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.get_buffer("inv_freq")
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_SHD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    cos = cos_SD[:, None, :].to(x_SHD.dtype)
    sin = sin_SD[:, None, :].to(x_SHD.dtype)
    return x_SHD * cos + _rotate_half(x_SHD) * sin


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Dense-mask attention (inference steps, CPU tests, the unfused baseline)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def flex_attention_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any
) -> torch.Tensor:
    """FlexAttention without compilation (materialises scores: the unfused path)."""
    from torch.nn.attention.flex_attention import flex_attention

    out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    assert isinstance(out, torch.Tensor)
    return out


class DrafterAttention(nn.Module):
    def __init__(self, spec: DrafterSpec, layer_idx: int) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads = spec.num_attention_heads
        self.num_kv_heads = spec.num_key_value_heads
        self.head_dim = d
        bias = spec.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        sliding = spec.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window: int | None = spec.sliding_window if sliding else None

    def keys_values(
        self, x_SH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm + RoPE) and V, [S, Hkv, D]."""
        s = x_SH.shape[0]
        k = self.k_norm(self.k_proj(x_SH).view(s, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_SH).view(s, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x_QH: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos_q: torch.Tensor,
        sin_q: torch.Tensor,
        mask: Any,
        attn_fn: AttentionFn,
    ) -> torch.Tensor:
        n = x_QH.shape[0]
        q = self.q_norm(self.q_proj(x_QH).view(n, self.num_heads, self.head_dim))
        q = apply_rope(q, cos_q, sin_q)
        k_blk, v_blk = self.keys_values(x_QH, cos_q, sin_q)
        k = torch.cat([ctx_k.to(k_blk.dtype), k_blk], 0)
        v = torch.cat([ctx_v.to(v_blk.dtype), v_blk], 0)
        out = attn_fn(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim))


class DrafterMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class RawContext:
    """The projected context before a layer's k/v projections (training)."""

    hidden_TH: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


ContextInput = RawContext | tuple[torch.Tensor, torch.Tensor]
"""RawContext (training) or a layer's cached (K, V) (inference)."""


class DrafterLayer(nn.Module):
    def __init__(self, spec: DrafterSpec, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(spec, layer_idx)
        self.mlp = DrafterMLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attention_conv: GroupedDynamicConv | None = None
        self.mlp_conv: GroupedDynamicConv | None = None
        if spec.is_dflash2:
            k, g = spec.conv_kernel_size, spec.conv_group_size
            self.attention_conv = GroupedDynamicConv(spec.hidden_size, k, g)
            self.mlp_conv = GroupedDynamicConv(spec.hidden_size, k, g)

    def forward(
        self,
        h_QH: torch.Tensor,
        ctx: ContextInput,
        cos_q: torch.Tensor,
        sin_q: torch.Tensor,
        mask: Any,
        attn_fn: AttentionFn,
        block_len: int = 0,
    ) -> torch.Tensor:
        """`block_len`: slots per block of the rows (DFlash2's convolutions stay inside it)."""
        # The context's K/V are projected here, inside the layer's own forward, so that
        # wrappers that gather parameters around forward (FSDP2) see every use.
        if isinstance(ctx, RawContext):
            ctx_k, ctx_v = self.self_attn.keys_values(ctx.hidden_TH, ctx.cos, ctx.sin)
        else:
            ctx_k, ctx_v = ctx

        def attn(x: torch.Tensor) -> torch.Tensor:
            return self.self_attn(x, ctx_k, ctx_v, cos_q, sin_q, mask, attn_fn)

        h_QH = h_QH + _around(self.attention_conv, attn, self.input_layernorm(h_QH), block_len)
        x = self.post_attention_layernorm(h_QH)
        return h_QH + _around(self.mlp_conv, self.mlp, x, block_len)


def _around(
    conv: GroupedDynamicConv | None,
    sublayer: Callable[[torch.Tensor], torch.Tensor],
    x_QH: torch.Tensor,
    block_len: int,
) -> torch.Tensor:
    """sublayer(x), or with DFlash2 its two-sided convolution: conv_out(sublayer(conv_in(x)))
    with both sides' coefficients predicted from x. The context's K/V never pass through it."""
    if conv is None:
        return sublayer(x_QH)
    d = conv.coefficients(x_QH)
    y = sublayer(conv.apply_side(0, x_QH, d, block_len))
    return conv.apply_side(1, y, d, block_len)


@dataclass
class ContextCache:
    """Per-layer projected context K/V ([S, Hkv, D], after k_norm and RoPE)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    def crop(self, length: int) -> None:
        self.keys = [k[:length] for k in self.keys]
        self.values = [v[:length] for v in self.values]


class DFlashDrafter(nn.Module):
    def __init__(
        self, spec: DrafterSpec, noise_std: float = 0.0, selector_codebooks: str = "tables"
    ) -> None:
        """`selector_codebooks`: how a DFlash2 selector's codebooks are trained
        (CandidateSelector); every drafter file holds them as tables."""
        super().__init__()
        self.spec = spec
        self.noise_std = noise_std
        self.fc = nn.Linear(spec.num_context_features, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = Rotary(spec.head_dim, spec.rope_theta)
        self.candidate_selector: CandidateSelector | None = None
        if spec.is_dflash2:
            self.candidate_selector = CandidateSelector(
                spec.hidden_size, spec.vocab_size, spec.selector_rank, selector_codebooks
            )
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        # After the generic pass (which would re-draw their linears): DFlash2's modules
        # start as exact no-ops.
        for m in self.modules():
            if isinstance(m, (GroupedDynamicConv, CandidateSelector)):
                m.reset_parameters()

    @property
    def drafter_layers(self) -> list[DrafterLayer]:
        # torch.compile wraps a layer in an OptimizedModule; its original is _orig_mod.
        out = [getattr(m, "_orig_mod", m) for m in self.layers]
        assert all(isinstance(m, DrafterLayer) for m in out)
        return out  # type: ignore[return-value]

    def project_context(self, features_TF: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(features)), with U(-s, s) noise on the features in training only.

        Noise goes on the drafter's *input* copy of the features only: the target's own
        outputs define the labels, and noise there would train towards perturbed labels.
        """
        if self.training and self.noise_std > 0:
            noise = torch.rand_like(features_TF).mul_(2 * self.noise_std).sub_(self.noise_std)
            features_TF = features_TF + noise
        return self.hidden_norm(self.fc(features_TF))

    def context_kv(
        self, ctx_TH: torch.Tensor, positions_T: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cos, sin = self.rotary(positions_T)
        return [layer.self_attn.keys_values(ctx_TH, cos, sin) for layer in self.drafter_layers]

    def run_layers(
        self,
        h_QH: torch.Tensor,
        ctx: Sequence[ContextInput],
        positions_Q: torch.Tensor,
        masks: dict[str, Any],
        attn_fn: AttentionFn,
        block_len: int,
    ) -> torch.Tensor:
        """The layers over block rows [Q, H] (whole blocks of `block_len` slots), normed."""
        cos_q, sin_q = self.rotary(positions_Q)
        for layer, c, kind in zip(self.layers, ctx, self.spec.layer_types):
            h_QH = layer(h_QH, c, cos_q, sin_q, masks[kind], attn_fn, block_len)
        return self.norm(h_QH)

    def forward(
        self,
        features_TF: torch.Tensor,
        ctx_positions_T: torch.Tensor,
        block_emb_QH: torch.Tensor,
        block_positions_Q: torch.Tensor,
        masks: dict[str, Any],
        attn_fn: AttentionFn = sdpa_attention,
    ) -> torch.Tensor:
        """Training forward over all blocks of a pack: normed hidden states [Q, H].

        `masks` maps each layer type in use to a BlockMask (flex attn_fn) or a dense
        bool [Q, T+Q] mask (sdpa_attention).
        """
        ctx = self.project_context(features_TF)
        cos, sin = self.rotary(ctx_positions_T)
        raw = [RawContext(ctx, cos, sin)] * len(self.layers)
        b = self.spec.block_size
        return self.run_layers(block_emb_QH, raw, block_positions_Q, masks, attn_fn, b)

    # ------------------------------------------------------------------ inference

    def new_cache(self) -> ContextCache:
        return ContextCache()

    def extend_cache(
        self, cache: ContextCache, features_SF: torch.Tensor, positions_S: torch.Tensor
    ) -> None:
        """Append the projected K/V of newly committed tokens' features."""
        if features_SF.shape[0] == 0:
            return
        kv = self.context_kv(self.project_context(features_SF), positions_S)
        if not cache.keys:
            cache.keys = [k for k, _ in kv]
            cache.values = [v for _, v in kv]
            return
        cache.keys = [torch.cat([old, k], 0) for old, (k, _) in zip(cache.keys, kv)]
        cache.values = [torch.cat([old, v], 0) for old, (_, v) in zip(cache.values, kv)]

    def step(
        self,
        cache: ContextCache,
        block_emb_BH: torch.Tensor,
        anchor_position: int,
    ) -> torch.Tensor:
        """One block [anchor, MASK x (B-1)] against the cached context: normed hidden [B, H].

        The cache must hold exactly positions 0..anchor_position-1 of this sequence.
        """
        b = block_emb_BH.shape[0]
        if cache.length != anchor_position:
            raise ValueError(
                f"context cache holds {cache.length} positions but the anchor is at "
                f"{anchor_position}; extend or crop the cache to the committed prefix first"
            )
        dev = block_emb_BH.device
        positions = torch.arange(anchor_position, anchor_position + b, device=dev)
        masks = {
            kind: inference_mask(
                anchor_position,
                b,
                self.spec.sliding_window if kind == "sliding_attention" else None,
                dev,
            )
            for kind in set(self.spec.layer_types)
        }
        if not cache.keys:
            hkv, d = self.spec.num_key_value_heads, self.spec.head_dim
            empty = block_emb_BH.new_zeros(0, hkv, d)
            kv: list[ContextInput] = [(empty, empty) for _ in self.layers]
        else:
            kv = list(zip(cache.keys, cache.values))
        return self.run_layers(block_emb_BH, kv, positions, masks, sdpa_attention, b)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
