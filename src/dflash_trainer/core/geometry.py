"""Derive the concrete drafter geometry (`DrafterSpec`) from the target's HF config.

Only three things must match the target: hidden_size (the drafter shares the target's
embed_tokens and lm_head), vocab_size, and H_target (fc's input width). Attention
geometry is the drafter's own: copying the target's heads / KV heads / head dim gives a
bigger, slower drafter that published drafter weights cannot load into, so it comes from
a preset or explicit fields, never from the target (docs/algorithm.md section 1).

`attention_geometry` is the one rule for heads / KV heads / head dim: training raises
its first broken rule (via resolve_drafter_spec), `dflash doctor` reports all of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_trainer.config import GEOMETRY_PRESETS, ConfigError, DrafterConfig


@dataclass(frozen=True)
class DrafterSpec:
    """Every number the drafter model and its exports need; nothing left to defaults."""

    hidden_size: int
    vocab_size: int
    target_hidden_size: int
    num_target_hidden_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str = "silu"
    attention_bias: bool = False
    kind: str = "dflash"
    """dflash | dflash2 (the four fields below are read only for dflash2)."""
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    @property
    def is_dflash2(self) -> bool:
        return self.kind == "dflash2"

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterSpec:
        d = dict(d)
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)


DFLASH2_FIELDS = ("kind", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def init_differences(theirs: DrafterSpec, mine: DrafterSpec) -> dict[str, tuple[Any, Any]]:
    """Fields in which a drafter to start from differs from this run's: {field: (theirs, mine)}.

    A DFlash drafter may start a DFlash2 run: the backbone must match and the new modules
    start as no-ops, so the DFlash2 fields are not compared then. The block size is no
    weight's dimension: a drafter trained at one block size may continue at another. The
    sliding window is compared only where a layer of either uses it: an export of a drafter
    with full attention everywhere records none, whatever the config it came from said.
    """
    skip: tuple[str, ...] = ("block_size",)
    if (theirs.kind, mine.kind) == ("dflash", "dflash2"):
        skip += DFLASH2_FIELDS
    if "sliding_attention" not in (*theirs.layer_types, *mine.layer_types):
        skip += ("sliding_window",)
    a, b = theirs.to_dict(), mine.to_dict()
    return {k: (a[k], b[k]) for k in a if k not in skip and a[k] != b[k]}


def dflash2_problems(spec: DrafterSpec) -> list[str]:
    """What makes a DFlash2 spec unbuildable, each with its fix (empty for DFlash).

    The doctor reports all of them; resolve_drafter_spec raises the first.
    """
    if not spec.is_dflash2:
        return []
    out = []
    h, g = spec.hidden_size, spec.conv_group_size
    if h % g != 0:
        out.append(
            f"drafter.conv_group_size={g} does not divide hidden_size={h} ({h} % {g} = "
            f"{h % g}): each group of channels shares one coefficient; pick a divisor "
            f"(e.g. {_divisor_near(h, g)})"
        )
    if spec.conv_kernel_size > spec.block_size:
        out.append(
            f"drafter.conv_kernel_size={spec.conv_kernel_size} exceeds block_size="
            f"{spec.block_size}: taps never leave their block; use at most block_size"
        )
    if spec.selector_top_k > spec.vocab_size:
        out.append(
            f"drafter.selector_top_k={spec.selector_top_k} exceeds the target vocabulary "
            f"({spec.vocab_size} tokens); use at most the vocabulary size (default 16)"
        )
    return out


def _divisor_near(n: int, want: int) -> int:
    """The divisor of n closest to `want` (a suggestion in an error message)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - want), d))


def default_target_layer_ids(num_hidden_layers: int, n: int) -> tuple[int, ...]:
    """z-lab's spread: round(1 + i*(L-4)/(n-1)) for n > 1, L//2 for n = 1.

    Python's round (half to even) as in the reference, so exports match published ids.
    """
    if n == 1:
        return (num_hidden_layers // 2,)
    if num_hidden_layers < 4:
        # The formula needs L >= 4; tiny test targets tap evenly instead.
        return tuple(sorted({round(i * (num_hidden_layers - 1) / (n - 1)) for i in range(n)}))
    return tuple(round(1 + i * (num_hidden_layers - 4) / (n - 1)) for i in range(n))


def target_layer_ids(dcfg: DrafterConfig, num_hidden_layers: int) -> tuple[int, ...]:
    """The tapped layers: drafter.target_layer_ids when given, else the default spread."""
    return dcfg.target_layer_ids or default_target_layer_ids(
        num_hidden_layers, dcfg.num_target_layers
    )


def text_config(hf_config: Any) -> Any:
    """The language-model part of a (possibly multimodal) HF config."""
    getter = getattr(hf_config, "get_text_config", None)
    return getter() if callable(getter) else hf_config


def rope_theta_of(cfg: Any, default: float = 10000.0) -> float:
    """rope_theta flat (transformers 4) or inside rope_parameters (transformers 5)."""
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict):
        if "rope_theta" in rp:
            return float(rp["rope_theta"])
        for sub in rp.values():  # per-layer-type nesting (e.g. gemma3)
            if isinstance(sub, dict) and "rope_theta" in sub:
                return float(sub["rope_theta"])
    theta = getattr(cfg, "rope_theta", None)
    return float(theta) if theta is not None else default


# The rules an attention geometry can break, in the order resolve_drafter_spec reports them.
GeometryRule = Literal[
    "unset", "llama_divisibility", "llama_head_dim", "head_dim_unset", "gqa", "rope_even"
]


@dataclass(frozen=True)
class AttentionGeometry:
    """The drafter's heads / KV heads / head dim as the config picks them, and what they break.

    `broken` maps each broken rule to the ConfigError message resolve_drafter_spec raises
    for it; the doctor reports every entry, training stops at the first.
    """

    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    source: str
    """Where the numbers came from: a preset, explicit fields, or a preset plus overrides."""
    broken: dict[GeometryRule, str] = field(default_factory=dict)


def attention_geometry(dcfg: DrafterConfig, hidden: int) -> AttentionGeometry:
    """Explicit fields win over the preset; a llama-class head_dim is hidden / heads.

    Never the target's attention geometry: copying it gives a bigger, slower drafter that
    published drafter weights cannot load into.
    """
    preset = GEOMETRY_PRESETS.get(dcfg.geometry or "", {})
    heads: int | None = dcfg.num_attention_heads or preset.get("num_attention_heads")
    kv_heads = dcfg.num_key_value_heads or preset.get("num_key_value_heads")
    head_dim = dcfg.head_dim or preset.get("head_dim")
    explicit = [
        n for n in ("num_attention_heads", "num_key_value_heads", "head_dim") if getattr(dcfg, n)
    ]
    source = f"preset {dcfg.geometry}" if preset else "explicit fields"
    if preset and explicit:
        source += " + explicit " + ", ".join(explicit)
    broken: dict[GeometryRule, str] = {}
    if heads is None or kv_heads is None:
        broken["unset"] = (
            "drafter.num_attention_heads / drafter.num_key_value_heads: not set and no "
            "drafter.geometry preset; choose a preset (e.g. drafter.geometry=qwen3) or "
            "give both explicitly (the drafter never copies the target's attention geometry)"
        )
        return AttentionGeometry(heads, kv_heads, head_dim, source, broken)
    if dcfg.layer_class == "llama":
        head_dim = _llama_head_dim(dcfg, hidden, heads, broken)
    elif head_dim is None:
        broken["head_dim_unset"] = (
            "drafter.head_dim: not set and no drafter.geometry preset gives it"
        )
    if heads % kv_heads != 0:
        broken["gqa"] = (
            f"drafter.num_attention_heads={heads} is not a multiple of "
            f"drafter.num_key_value_heads={kv_heads}; grouped-query attention needs "
            "each KV head to serve the same number of query heads"
        )
    if head_dim is not None and head_dim % 2 != 0:
        broken["rope_even"] = f"drafter.head_dim={head_dim} must be even for RoPE"
    return AttentionGeometry(heads, kv_heads, head_dim, source, broken)


def _llama_head_dim(
    dcfg: DrafterConfig, hidden: int, heads: int, broken: dict[GeometryRule, str]
) -> int | None:
    """A llama-class drafter has head_dim = hidden / heads; None when heads do not divide."""
    if hidden % heads != 0:
        broken["llama_divisibility"] = (
            f"drafter.num_attention_heads={heads} does not divide target hidden_size="
            f"{hidden} ({hidden} % {heads} = {hidden % heads}); a llama-class drafter "
            f"needs hidden_size % num_attention_heads == 0. Use drafter.layer_class=qwen3 "
            f"(free head_dim) or a head count that divides {hidden}"
        )
        return None
    llama_hd = hidden // heads
    if dcfg.head_dim is not None and dcfg.head_dim != llama_hd:
        broken["llama_head_dim"] = (
            f"drafter.head_dim={dcfg.head_dim} but a llama-class drafter has head_dim = "
            f"hidden_size / num_attention_heads = {llama_hd}; drop head_dim or use "
            "drafter.layer_class=qwen3"
        )
    return llama_hd


def resolve_drafter_spec(dcfg: DrafterConfig, target_hf_config: Any) -> DrafterSpec:
    """Combine the drafter knobs with the target's shared dims; validate the result."""
    t = text_config(target_hf_config)
    hidden = int(t.hidden_size)
    vocab = int(t.vocab_size)
    n_layers_t = int(t.num_hidden_layers)

    layer_ids = target_layer_ids(dcfg, n_layers_t)
    bad = [i for i in layer_ids if not 0 <= i < n_layers_t]
    if bad:
        raise ConfigError(
            f"drafter.target_layer_ids: {bad} out of range for a target with "
            f"{n_layers_t} layers (valid ids 0..{n_layers_t - 1}; ids are 0-based "
            "decoder layers, not hidden_states indices)"
        )
    attn = attention_geometry(dcfg, hidden)
    if attn.broken:
        raise ConfigError(next(iter(attn.broken.values())))
    assert attn.heads is not None and attn.kv_heads is not None and attn.head_dim is not None
    mask_token_id = _mask_token_id(dcfg, vocab)

    intermediate = dcfg.intermediate_size or int(getattr(t, "intermediate_size", 4 * hidden))
    spec = DrafterSpec(
        hidden_size=hidden,
        vocab_size=vocab,
        target_hidden_size=hidden,
        num_target_hidden_layers=n_layers_t,
        target_layer_ids=tuple(int(i) for i in layer_ids),
        block_size=dcfg.block_size,
        mask_token_id=mask_token_id,
        num_layers=dcfg.num_layers,
        num_attention_heads=int(attn.heads),
        num_key_value_heads=int(attn.kv_heads),
        head_dim=int(attn.head_dim),
        intermediate_size=int(intermediate),
        rope_theta=float(dcfg.rope_theta or rope_theta_of(t)),
        layer_types=dcfg.resolved_layer_types(),
        sliding_window=dcfg.sliding_window,
        rms_norm_eps=float(dcfg.rms_norm_eps),
        max_position_embeddings=int(
            dcfg.max_position_embeddings or getattr(t, "max_position_embeddings", None) or 32768
        ),
        kind=dcfg.kind,
        conv_kernel_size=dcfg.conv_kernel_size,
        conv_group_size=dcfg.conv_group_size,
        selector_rank=dcfg.selector_rank,
        selector_top_k=dcfg.selector_top_k,
    )
    problems = dflash2_problems(spec)
    if problems:
        raise ConfigError(problems[0])
    return spec


def _mask_token_id(dcfg: DrafterConfig, vocab: int) -> int:
    """drafter.mask_token_id, which must be set and inside the target's vocab."""
    if dcfg.mask_token_id is None:
        raise ConfigError(
            "drafter.mask_token_id: required. Pick a token id that never occurs in the "
            "training data and is not EOS/PAD (Qwen3: 151669, Qwen3.5/3.6: 248070, "
            "SmolLM2: 16 <empty_output>); `dflash doctor --data` checks it"
        )
    if not 0 <= dcfg.mask_token_id < vocab:
        raise ConfigError(
            f"drafter.mask_token_id={dcfg.mask_token_id} is outside the target vocab "
            f"(0..{vocab - 1})"
        )
    return int(dcfg.mask_token_id)
