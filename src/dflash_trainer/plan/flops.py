"""Parameters and FLOPs of a training step: target forward, drafter forward/backward, loss.

Counting rules (a FLOP is one multiply or one add, so a [m,k]x[k,n] matmul is 2mkn):
- Only matmul-class work is counted (linear layers, attention scores and values, the
  linear-attention scan, the lm_head): this is what tensor cores run and what
  `torch.utils.flop_counter.FlopCounterMode` counts, which the tests compare against.
- Drafter backward = 2x forward for every linear layer (input and weight grads) except
  `fc`, whose input (the target's features) needs no gradient: 1x. Attention backward
  is 2x forward as model FLOPs; fused kernels (FlexAttention, flash) also recompute the
  scores, so the time model uses `FUSED_ATTENTION_BACKWARD` = 2.5x.
- Loss: lm_head over R rows forward (2RHV) plus the hidden-state gradient (2RHV); the
  lm_head is the frozen target's, so there is no weight gradient and nothing is
  recomputed (loss.py fuses both into one pass per chunk). KL adds the target's logits
  over the same rows (2RHV), which loss.py recomputes from the kept final hidden rows.
- Target: 2 x (decoder linear weights) per padded token, attention pairs of its full
  layers (a padded dense-mask kernel computes all D*L_max^2), the chunked gated delta
  rule of its linear-attention layers, and the lm_head on the R rows whose argmax is a
  label. The target's parameter shapes come from instantiating it on the meta device,
  so any HF architecture is counted from its real modules, not from a formula.

Drafter attention is reported three ways (workload.AttentionPairs): dense (what the
SDPA/eager path computes), visible (the rule's pairs) and tiles (what block-sparse
FlexAttention computes, at 128x128 granularity).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_trainer.core.geometry import DrafterSpec, text_config
from dflash_trainer.plan.workload import StepShape

FUSED_ATTENTION_BACKWARD = 2.5
"""Executed backward/forward FLOPs of a fused attention kernel (recomputes the scores)."""
GDN_CHUNK = 64
"""Chunk length of the chunked gated-delta-rule kernels (fla and transformers' fallback)."""

AttentionCount = Literal["dense", "visible", "tiles"]


@dataclass(frozen=True)
class Term:
    """One FLOP term of the step."""

    name: str
    flops: float
    kind: Literal["linear", "attention", "scan", "lm_head"]


@dataclass
class Flops:
    terms: list[Term] = field(default_factory=list)

    def add(self, name: str, flops: float, kind: Any) -> None:
        self.terms.append(Term(name, float(flops), kind))

    def total(self, kind: str | None = None) -> float:
        return sum(t.flops for t in self.terms if kind is None or t.kind == kind)

    def by_name(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.terms:
            out[t.name] = out.get(t.name, 0.0) + t.flops
        return out


# ----------------------------------------------------------------------------- drafter


def drafter_param_counts(spec: DrafterSpec, codebooks: str = "tables") -> dict[str, int]:
    """Exact parameter counts of `DFlashDrafter(spec, selector_codebooks=codebooks)` by part
    (the trained ones: embedding-mode codebooks are [H, r] factors, not [V, r] tables)."""
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    hq, hkv = spec.num_attention_heads, spec.num_key_value_heads
    bias = spec.attention_bias
    attn = h * hq * d + 2 * h * hkv * d + hq * d * h + 2 * d
    if bias:
        attn += hq * d + 2 * hkv * d + h
    layer = attn + 3 * h * inter + 2 * h
    out = {
        "fc": spec.num_context_features * h,
        "layers": spec.num_layers * layer,
        "norms": 2 * h,  # hidden_norm and the final norm
    }
    if spec.is_dflash2:
        k, groups = spec.conv_kernel_size, h // spec.conv_group_size
        # Two convolutions a layer: base kernel [2, k, H] + projection [2kG, H].
        out["convolutions"] = spec.num_layers * 2 * (2 * k * h + 2 * k * groups * h)
        r = spec.selector_rank
        rows = spec.vocab_size if codebooks == "tables" else h
        out["selector"] = r * h + 2 * rows * r
    return out


def drafter_params(spec: DrafterSpec, codebooks: str = "tables") -> int:
    return sum(drafter_param_counts(spec, codebooks).values())


def drafter_forward_flops(
    spec: DrafterSpec, shape: StepShape, attention: AttentionCount = "tiles"
) -> Flops:
    """Forward matmul FLOPs of the drafter over one step."""
    t, q = shape.ctx_len, shape.queries
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    hq, hkv = spec.num_attention_heads, spec.num_key_value_heads
    f = Flops()
    f.add("fc", 2 * t * spec.num_context_features * h, "linear")
    for kind in spec.layer_types:
        f.add("q_proj", 2 * q * h * hq * d, "linear")
        # K/V of the context (T rows, once per layer) and of the block slots (Q rows).
        f.add("kv_proj", 2 * 2 * (t + q) * h * hkv * d, "linear")
        f.add("o_proj", 2 * q * hq * d * h, "linear")
        f.add("mlp", 3 * 2 * q * h * inter, "linear")
        pairs = getattr(shape.pairs[kind], attention)
        f.add(f"attention.{kind}", 2 * 2 * hq * d * pairs, "attention")
        if spec.is_dflash2:  # the two convolutions' coefficient projections
            groups = h // spec.conv_group_size
            f.add("conv_proj", 2 * 2 * q * h * 2 * spec.conv_kernel_size * groups, "linear")
    return f


def selector_flops(spec: DrafterSpec, rows: float, codebooks: str = "tables") -> Flops:
    """DFlash2's selector term over R rows, forward and backward: the gate P h (2RHr, and 4RHr
    back: the input and weight gradients) and the pair scores of K candidates (2RKr, and 4RKr
    back); embedding-mode codebooks add E' W for the rows of both tables (2 x rows x Hr, and
    as much back: the weight gradient only, E' is frozen)."""
    f = Flops()
    if not spec.is_dflash2:
        return f
    r, k = spec.selector_rank, spec.selector_top_k
    f.add("selector.gate", 3 * 2 * rows * spec.hidden_size * r, "linear")
    f.add("selector.pairs", 3 * 2 * rows * k * r, "linear")
    if codebooks == "embedding":
        # A's rows for R predecessors, B's for R x K candidates; each side projects its
        # gathered rows or, when they outnumber the vocabulary, the whole table.
        side_rows = min(spec.vocab_size, rows) + min(spec.vocab_size, rows * k)
        f.add("selector.codebooks", 2 * 2 * side_rows * spec.hidden_size * r, "linear")
    return f


def drafter_backward_flops(
    spec: DrafterSpec, shape: StepShape, attention: AttentionCount = "tiles", fused: bool = False
) -> Flops:
    """Backward matmul FLOPs; `fused` counts the score recompute of fused attention."""
    fwd = drafter_forward_flops(spec, shape, attention)
    f = Flops()
    for term in fwd.terms:
        if term.name == "fc":
            f.add("fc", term.flops, term.kind)  # weight grad only: features need no grad
        elif term.kind == "attention":
            f.add(term.name, term.flops * (FUSED_ATTENTION_BACKWARD if fused else 2.0), term.kind)
        else:
            f.add(term.name, 2 * term.flops, term.kind)
    return f


def loss_flops(spec: DrafterSpec, rows: float, loss: str) -> Flops:
    """The fused lm_head + loss over R rows: logits, hidden grad, and KL's target logits."""
    one = 2 * rows * spec.hidden_size * spec.vocab_size
    f = Flops()
    f.add("lm_head.forward", one, "lm_head")
    f.add("lm_head.hidden_grad", one, "lm_head")
    if loss in ("kl", "lk"):  # the target's distribution over the same rows
        f.add("lm_head.target_logits", one, "lm_head")
    return f


# ------------------------------------------------------------------------------ target


@dataclass(frozen=True)
class TargetLayer:
    kind: str
    """full_attention, sliding_attention or linear_attention."""
    linear_params: int
    """Weights of nn.Linear modules in the layer (2 FLOPs per weight per token)."""
    conv_channels: int = 0
    """Depthwise conv1d channels (linear-attention layers)."""
    fp8_params: int = 0
    """Weights of the linears an FP8 target converts (target/fp8.py: aligned, not routers)."""
    fp8_inputs: int = 0
    """Their in_features summed: activation values an FP8 target quantizes per token."""
    fp8_linears: int = 0
    """How many linears convert (each adds a quantization kernel in front of its matmul)."""


@dataclass(frozen=True)
class TargetModel:
    """What the planner needs of the target, read from its meta-device modules."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    total_params: int
    embed_params: int
    lm_head_params: int
    """0 when tied to the embeddings."""
    layers: tuple[TargetLayer, ...]
    num_heads: int
    head_dim: int
    sliding_window: int | None
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int
    intermediate_size: int
    notes: tuple[str, ...] = ()

    @property
    def decoder_linear_params(self) -> int:
        return sum(layer.linear_params for layer in self.layers)

    @property
    def decoder_fp8_params(self) -> int:
        return sum(layer.fp8_params for layer in self.layers)

    @property
    def kind_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.kind] = out.get(layer.kind, 0) + 1
        return out


@functools.lru_cache(maxsize=8)
def _describe_cached(config_json: str) -> TargetModel:
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_trainer.target.fp8 import skip_reason

    d = json.loads(config_json)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    # Meta tensors: exact shapes of a 27B model in about a second and no memory.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    layers = []
    for i, layer in enumerate(decoder.layers):
        linears = [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
        lin = sum(m.weight.numel() for _, m in linears)
        fp8 = [m for n, m in linears if skip_reason(n, m) is None]
        conv = sum(m.out_channels for m in layer.modules() if isinstance(m, nn.Conv1d))
        kind = layer_types[i] if i < len(layer_types) else "full_attention"
        layers.append(
            TargetLayer(
                kind,
                int(lin),
                int(conv),
                fp8_params=sum(m.weight.numel() for m in fp8),
                fp8_inputs=sum(m.in_features for m in fp8),
                fp8_linears=len(fp8),
            )
        )
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb
    notes = []
    if any(getattr(cfg, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        notes.append("mixture-of-experts target: every expert's FLOPs are counted (an upper bound)")
    heads = int(getattr(cfg, "num_attention_heads", 1))
    return TargetModel(
        model_type=str(cfg.model_type),
        num_layers=len(layers),
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
        total_params=int(sum(p.numel() for p in model.parameters())),
        embed_params=int(emb.numel()),
        lm_head_params=0 if tied or head is None else int(head.weight.numel()),
        layers=tuple(layers),
        num_heads=heads,
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        sliding_window=getattr(cfg, "sliding_window", None),
        linear_value_heads=int(getattr(cfg, "linear_num_value_heads", 0) or 0),
        linear_key_dim=int(getattr(cfg, "linear_key_head_dim", 0) or 0),
        linear_value_dim=int(getattr(cfg, "linear_value_head_dim", 0) or 0),
        conv_kernel=int(getattr(cfg, "linear_conv_kernel_dim", 0) or 0),
        intermediate_size=int(getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)),
        notes=tuple(notes),
    )


def describe_target(hf_config: Any) -> TargetModel:
    """Parameter layout of the target's text model (cached per config)."""
    t = text_config(hf_config)
    d = t.to_dict()
    d["model_type"] = t.model_type
    for key in ("architectures", "auto_map", "transformers_version", "_name_or_path"):
        d.pop(key, None)
    return _describe_cached(json.dumps(d, sort_keys=True, default=str))


def gdn_flops_per_token_head(dk: int, dv: int, chunk: int = GDN_CHUNK) -> tuple[float, float]:
    """(matmul, triangular-solve) FLOPs per token and value head of the chunked delta rule.

    Per chunk of C tokens: K_beta K^T and Q K^T (2 C^2 Dk each), the intra-chunk
    output (2 C^2 Dv), the state read by K and by Q and the state update
    (2 C Dk Dv each); the UT transform solves two unit-triangular systems (C^2 Dv and
    C^2 Dk). Divided by C, per token.
    """
    matmul = 4 * chunk * dk + 2 * chunk * dv + 6 * dk * dv
    solve = chunk * (dk + dv)
    return float(matmul), float(solve)


def target_forward_flops(
    target: TargetModel, shape: StepShape, layers_run: int, lm_head_rows: float
) -> Flops:
    """Target forward over the padded batch, up to `layers_run` decoder layers."""
    tok = shape.target_padded_tokens
    f = Flops()
    for layer in target.layers[:layers_run]:
        f.add(f"linear.{layer.kind}", 2 * tok * layer.linear_params, "linear")
        if layer.kind in ("full_attention", "sliding_attention"):
            pairs = shape.target_attn_pairs
            w = target.sliding_window
            if layer.kind == "sliding_attention" and w:
                pairs = shape.target_padded_tokens * min(w, shape.target_max_len)
            f.add(
                f"attention.{layer.kind}",
                4 * target.num_heads * target.head_dim * pairs,
                "attention",
            )
        elif layer.kind == "linear_attention":
            mm, solve = gdn_flops_per_token_head(target.linear_key_dim, target.linear_value_dim)
            # Each row is padded to a whole number of chunks.
            chunked = -(-shape.target_max_len // GDN_CHUNK) * GDN_CHUNK
            scan_tok = tok * chunked / max(shape.target_max_len, 1.0)
            heads = target.linear_value_heads
            f.add("linear_attention.scan", scan_tok * heads * mm, "scan")
            f.add("linear_attention.solve", scan_tok * heads * solve, "scan")
            # The causal conv1d computes K-1 extra outputs per row (its padding).
            conv_tok = tok + shape.docs * (target.conv_kernel - 1)
            f.add(
                "linear_attention.conv",
                2 * conv_tok * target.conv_kernel * layer.conv_channels,
                "scan",
            )
    if lm_head_rows:
        f.add(
            "lm_head.labels", 2 * lm_head_rows * target.hidden_size * target.vocab_size, "lm_head"
        )
    return f
