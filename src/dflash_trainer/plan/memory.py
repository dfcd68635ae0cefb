"""Bytes per GPU of a training step, by role: a ledger read off the code, not a rule of thumb.

Shape legend: T = pack length, Q = N*B queries, KV = T + Q, R = rows with a loss,
H = hidden, F = n_tapped * H_target, Hq/Hkv/D = drafter heads/kv heads/head dim,
I = intermediate, V = vocab, P = drafter parameters, a = compute-dtype bytes
(2 under bf16 autocast, 4 in fp32).

The drafter's activations are the tensors autograd saves for backward, listed op by
op from drafter.py / loss.py / step.py (what each op keeps is what its backward
formula needs). Two facts of that code matter most:
- RMSNorm upcasts to fp32 and multiplies by an fp32 weight, so under autocast every
  norm keeps an fp32 copy of its input plus a bf16 copy of the normalised rows, and
  its output is fp32: each linear that reads it keeps its own bf16 cast (3 for q/k/v,
  2 for gate/up; the context is cast twice per layer, for k_proj and v_proj).
- Attention keeps q, k, v, its output and the log-sum-exp; the unfused paths keep more:
  the CPU kernel an additive copy of the mask, the math kernel (CUDA SDPA with a mask
  and GQA, i.e. compile off) the fp32 probabilities [Hq, Q, KV] and fp32 K/V expanded
  to Hq heads, and it materialises [Hq, Q, KV] fp32 scores twice in forward and twice
  more in backward.
With training.compile (`compiled=True`: each drafter layer compiled by Inductor, with
FlexAttention inside) the layers save far less, because Inductor's min-cut partitioner
keeps only what is expensive to recompute: matmul outputs, reductions' results (the
norms' rsqrt) and every tensor a backward matmul or the attention backward reads
anyway; the norms' fp32 copies, casts, RoPE and SiLU are recomputed in the backward's
fused kernels. Per layer it keeps the layer's input, one bf16 cast per distinct linear
input (shared by q/k/v, by gate/up, and by the context's k/v), the raw q/k projections
before their norms, attention's q, k, v, output and log-sum-exp, the o_proj output (to
rebuild the residual), gate, up and their product (not silu(gate)), and the bf16 cast
of each weight. What runs outside the compiled layers (fc, hidden_norm, the final norm,
the loss) keeps the eager ledger.
Peaks are taken per phase of the step (loss forward, end of backward, optimizer), the
way the allocator sees them; `runtime_reserve` (CUDA context, workspaces) is added
only to the fit, because torch.cuda.max_memory_allocated does not see it.

Validated on CPU by tests/test_planner_memory.py against the bytes autograd actually
saves (saved_tensors_hooks) and the allocator's peak (the profiler's memory events); the
compiled ledger against a CPU compile that runs Inductor's own decompositions, joint
passes and partitioner but leaves the partitioned graphs to eager aten (Inductor's CPU
backend has no FlexAttention backward, and code generation does not change what the
forward graph hands to the backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.plan.flops import TargetModel, drafter_param_counts
from dflash_trainer.plan.workload import StepShape

Attention = Literal["flex", "math", "cpu"]
"""flex: compiled FlexAttention; math: CUDA SDPA with a dense mask (compile off); cpu: CPU SDPA."""

GB = 1e9


@dataclass
class Ledger:
    """Named byte counts."""

    items: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, nbytes: float) -> None:
        self.items[name] = self.items.get(name, 0.0) + float(nbytes)

    @property
    def total(self) -> float:
        return sum(self.items.values())

    def gb(self) -> dict[str, float]:
        return {k: round(v / GB, 3) for k, v in self.items.items()}


def _norm(led: Ledger, name: str, rows: float, dim: int, a: int, input_grad: bool) -> None:
    """RMSNorm's saved tensors: fp32 input copy and rsqrt (if the input needs grad), y."""
    if input_grad:
        led.add(name, 4 * rows * dim + 4 * rows)
    led.add(name, a * rows * dim)


def drafter_activations(
    spec: DrafterSpec,
    t: int,
    q: int,
    rows: float,
    bf16: bool,
    attention: Attention,
    noise: bool,
    lm_head_bytes: int = 2,
    feature_bytes: int = 2,
    compiled: bool = False,
) -> Ledger:
    """Bytes autograd saves for backward in one drafter forward + loss (inputs excluded).

    compiled: the layers run under torch.compile (training.compile), so they save what
    Inductor's partitioner keeps (`_compiled_layers`), not the eager ops' tensors.
    """
    if compiled and attention != "flex":
        raise ValueError("compiled layers run FlexAttention: use attention='flex'")
    a = 2 if bf16 else 4
    h, d = spec.hidden_size, spec.head_dim
    led = Ledger()
    # Context: fc keeps its input; it is a new tensor when noise is added, when step.py
    # upcasts non-fp32 features without autocast, or when autocast casts fp32 features.
    if noise or feature_bytes != a:
        led.add("context.features", a * t * spec.num_context_features)
    _norm(led, "context.hidden_norm", t, h, a, True)
    led.add("rope_tables", 4 * 2 * (t + q) * d)
    if compiled:
        _compiled_layers(led, spec, t, q, a)
    else:
        _eager_layers(led, spec, t, q, bf16, attention)
    _norm(led, "final_norm", q, h, a, True)
    led.add("loss.grad_hidden", lm_head_bytes * rows * spec.hidden_size + 8 * rows)
    if bf16 and not compiled:
        # Autocast caches one bf16 copy of every linear weight; linears save it.
        led.add("autocast_weights", 2 * linear_params(spec))
    return led


def _eager_layers(
    led: Ledger, spec: DrafterSpec, t: int, q: int, bf16: bool, attention: Attention
) -> None:
    a = 2 if bf16 else 4
    h, d = spec.hidden_size, spec.head_dim
    hq, hkv = spec.num_attention_heads, spec.num_key_value_heads
    kv = t + q
    n_layers = spec.num_layers
    # fp32: one ctx tensor shared by every k/v projection; bf16: a cast per projection.
    led.add("context.kv_inputs", (2 * n_layers * 2 if bf16 else 4) * t * h)
    for i in range(n_layers):
        _norm(led, "context.k_norm", t, hkv * d, a, True)
        _norm(led, "block.input_norm", q, h, a, i > 0)  # layer 0 reads frozen embeddings
        led.add("block.qkv_inputs", (3 * 2 if bf16 else 4) * q * h)
        _norm(led, "block.q_norm", q, hq * d, a, True)
        _norm(led, "block.k_norm", q, hkv * d, a, True)
        if attention == "math":
            # q scaled, K^T scaled and V expanded to Hq heads, probabilities: all fp32.
            led.add("attention.qkv", 4 * (q * hq * d + 2 * kv * hq * d))
            led.add("attention.probs", 4 * hq * q * kv)
            led.add("attention.mask", kv * q)
        else:
            led.add("attention.qkv", a * (q * hq * d + 2 * kv * hkv * d))
            led.add("attention.out_lse", a * q * hq * d + 4 * hq * q)
            if attention == "cpu":
                led.add("attention.mask", a * q * kv)  # the kernel's additive copy
        _layer_post_attention(led, spec, q, bf16, compiled=False)


def _compiled_layers(led: Ledger, spec: DrafterSpec, t: int, q: int, a: int) -> None:
    """What Inductor's partitioner saves per compiled layer (FlexAttention inside).

    Matmul outputs and the inputs of backward matmuls are never recomputed; pointwise
    work (norm upcasts, casts, RoPE, silu) is, from them and the norms' rsqrt.
    """
    h, d = spec.hidden_size, spec.head_dim
    hq, hkv = spec.num_attention_heads, spec.num_key_value_heads
    kv = t + q
    if a == 4:
        led.add("context.kv_inputs", 4 * t * h)  # ctx itself, shared by every layer
    for i in range(spec.num_layers):
        if a == 2:
            # Each layer's k/v projections share one cast of ctx (a graph of its own).
            led.add("context.kv_inputs", 2 * t * h)
        led.add("context.k_norm", a * t * hkv * d + 4 * t * hkv)  # k_proj's output, rsqrt
        if i > 0:
            # Layer 0's input is the frozen block embeddings, already an input of the step.
            led.add("block.layer_input", a * q * h)
        led.add("block.input_norm", 4 * q + a * q * h)  # rsqrt, the cast q/k/v share
        led.add("block.q_norm", a * q * hq * d + 4 * q * hq)
        led.add("block.k_norm", a * q * hkv * d + 4 * q * hkv)
        led.add("attention.qkv", a * (q * hq * d + 2 * kv * hkv * d))
        led.add("attention.out_lse", a * q * hq * d + 4 * hq * q)  # out is o_proj's input
        _layer_post_attention(led, spec, q, a == 2, compiled=True)
        if a == 2:
            led.add("layer_weights", 2 * _layer_linear_params(spec))


def _layer_post_attention(
    led: Ledger, spec: DrafterSpec, q: int, bf16: bool, compiled: bool
) -> None:
    """What a layer saves after its attention: o_proj input/output, post norm, MLP."""
    a = 2 if bf16 else 4
    h, inter = spec.hidden_size, spec.intermediate_size
    if compiled:
        # o_proj's output rebuilds the residual sum that post_norm's backward reads;
        # its input is attention's saved output.
        led.add("block.o_proj_output", a * q * h)
        led.add("block.post_norm", 4 * q + a * q * h)  # rsqrt, the cast gate/up share
        led.add("block.mlp", 3 * a * q * inter)  # gate, up, product; silu is recomputed
        return
    led.add("block.o_proj_input", a * q * spec.num_attention_heads * spec.head_dim)
    _norm(led, "block.post_norm", q, h, a, True)
    led.add("block.mlp_inputs", (2 * 2 if bf16 else 4) * q * h)
    led.add("block.mlp", 4 * a * q * inter)  # gate, silu(gate), up, product


def _layer_linear_params(spec: DrafterSpec) -> float:
    """Linear parameters of one layer (fc excluded: its input never needs a gradient)."""
    fc = spec.num_context_features * spec.hidden_size
    return (linear_params(spec) - fc) / spec.num_layers


def linear_params(spec: DrafterSpec) -> int:
    """Parameters of linear layers (weights and biases): what autocast casts to bf16."""
    norms = 2 * spec.num_layers * (spec.hidden_size + spec.head_dim) + 2 * spec.hidden_size
    return sum(drafter_param_counts(spec).values()) - norms


def loss_chunk_bytes(
    spec: DrafterSpec, rows: float, chunk_rows: int, loss: str, lm_head_bytes: int
) -> float:
    """Peak temporaries of one lm_head chunk in loss.py (fp32 logits, log-probs, grads)."""
    r = min(float(chunk_rows), rows)
    per = 24.0 if loss in ("kl", "lk") else 12.0 + (2 if lm_head_bytes == 2 else 0)
    return per * r * spec.vocab_size


def attention_transient(
    spec: DrafterSpec, t: int, q: int, bf16: bool, attention: Attention
) -> tuple[float, float]:
    """(forward, backward) temporaries of one attention call beyond what is saved."""
    a = 2 if bf16 else 4
    hq, hkv, d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    kv = t + q
    if attention == "math":
        # Forward: the raw scores next to the saved probabilities; backward: the
        # gradients of the probabilities and of the scores, and of expanded K/V.
        scores = 4.0 * hq * q * kv
        return scores, 2 * scores + 4 * 2 * kv * hq * d
    # Fused kernels: gradients of q, k, v (fp32 accumulation for GQA-reduced k/v).
    return 0.0, a * q * hq * d + 2 * 4 * kv * hkv * d


@dataclass(frozen=True)
class DrafterMemory:
    """Drafter-side bytes of one step."""

    static: dict[str, float]
    inputs: dict[str, float]
    activations: dict[str, float]
    phases: dict[str, float]
    """Peak allocated bytes in each phase: loss, backward, optimizer."""

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def activation_bytes(self) -> float:
        return sum(self.activations.values())


def _dflash2_inputs(
    spec: DrafterSpec, q: int, r: float, a: int, lm_head_bytes: int, codebooks: str
) -> dict[str, float]:
    """Bytes a DFlash2 drafter adds to a step's inputs."""
    h, v = spec.hidden_size, spec.vocab_size
    # Saved for backward: each convolution's padded input and per-slot kernels (about
    # k + 1 rows of [Q, H] a side), and the selector's codebook rows and scores over R x K.
    k, rk = spec.conv_kernel_size, r * spec.selector_top_k
    out = {
        "dflash2_convolutions": float(spec.num_layers * 2 * 2 * (k + 1) * a * q * h),
        "selector_scores": float(4.0 * rk * spec.selector_rank * 3 + 4.0 * rk),
    }
    if codebooks == "embedding":
        # The scaled embedding copy, and both [V, r] tables made from it with their grads.
        out["selector_embedding"] = float(lm_head_bytes * v * h)
        out["selector_tables"] = float(2 * 2 * 4.0 * v * spec.selector_rank)
    return out


def drafter_memory(
    spec: DrafterSpec,
    shape: StepShape,
    *,
    bf16: bool,
    attention: Attention,
    noise: bool,
    loss: str,
    chunk_rows: int,
    ddp: bool,
    lm_head_bytes: int = 2,
    feature_bytes: int = 2,
    target_tables: int = 1,
    compiled: bool = False,
    codebooks: str = "tables",
) -> DrafterMemory:
    """compiled: training.compile (Inductor layers, FlexAttention); see drafter_activations.
    codebooks: drafter.selector_codebooks (embedding: no [V, r] tables among the parameters,
    but the scaled embedding copy and both materialised tables and their gradients)."""
    t, q, r = shape.ctx_len, shape.queries, shape.rows
    h, v = spec.hidden_size, spec.vocab_size
    p = sum(drafter_param_counts(spec, codebooks).values())
    a = 2 if bf16 else 4
    static = {"params_fp32": 4.0 * p, "adam_moments": 8.0 * p}
    if ddp:
        static["ddp_grad_buckets"] = 4.0 * p
    inputs = {
        "features": float(feature_bytes * t * spec.num_context_features),
        "block_embeddings": float(a * q * h),
        "masks": float(len(set(spec.layer_types)) * q * (t + q)) if attention != "flex" else 0.0,
    }
    if loss in ("kl", "lk"):
        inputs["target_hidden_rows"] = float(lm_head_bytes * q * h)
    if spec.is_dflash2:
        inputs.update(_dflash2_inputs(spec, q, r, a, lm_head_bytes, codebooks))
    if target_tables:
        # The target's lm_head (and, in pairs, its embedding table) kept on this GPU.
        inputs["target_tables"] = float(target_tables * lm_head_bytes * v * h)
    act = drafter_activations(
        spec, t, q, r, bf16, attention, noise, lm_head_bytes, feature_bytes, compiled
    )
    saved = act.total
    base = sum(static.values()) + sum(inputs.values())
    # Loss forward: everything saved, the fp32 hidden [Q,H], its gathered rows (fp32 and
    # lm_head dtype), and one chunk's temporaries.
    hidden = 4.0 * q * h + 4.0 * r * h + lm_head_bytes * r * h
    loss_peak = base + saved + hidden + loss_chunk_bytes(spec, r, chunk_rows, loss, lm_head_bytes)
    fwd_t, bwd_t = attention_transient(spec, t, q, bf16, attention)
    # At the last layer's attention (forward) and at the top layer's attention backward,
    # what that layer saves after its attention, the final norm and the loss's rows are
    # not (or no longer) held.
    tail = Ledger()
    _layer_post_attention(tail, spec, q, bf16, compiled)
    after_attn = tail.total + act.items["final_norm"] + act.items["loss.grad_hidden"]
    fwd_peak = base + saved - after_attn + fwd_t
    # Backward: early, every saved tensor plus the top layer's MLP gradients (two [Q, I]
    # while down_proj's fp32 weight grad forms), then its attention backward; late, every
    # parameter gradient exists while the context's activations (read by every layer)
    # are still saved.
    inter = spec.intermediate_size
    mlp_grads = a * 2.0 * q * inter + 4.0 * h * inter
    layer_params = (sum(drafter_param_counts(spec, codebooks).values()) - 2 * h) / spec.num_layers
    attn_bwd = base + saved - after_attn + bwd_t + 4.0 * layer_params
    ctx_keys = [k for k in act.items if k.startswith(("context", "rope", "autocast"))]
    ctx_saved = sum(act.items[k] for k in ctx_keys)
    ctx_grads = 4.0 * t * (h + 4 * spec.num_layers * spec.num_key_value_heads * spec.head_dim)
    early = max(base + saved + mlp_grads, attn_bwd)
    late = base + 4.0 * p + ctx_saved + ctx_grads
    opt = base + 4.0 * p
    phases = {
        "forward": fwd_peak,
        "loss": loss_peak,
        "backward": max(early, late),
        "optimizer": opt,
    }
    return DrafterMemory(static, inputs, dict(act.items), phases)


@dataclass(frozen=True)
class TargetMemory:
    weights: float
    forward_peak: float
    """Transient bytes of the largest layer of one micro-batch, plus kept features."""
    features: float

    @property
    def peak(self) -> float:
        return self.weights + self.forward_peak


def target_memory(
    target: TargetModel,
    shape: StepShape,
    n_tapped: int,
    fp8: bool,
    micro_tokens: int,
    need_final: bool,
    shards: int = 1,
) -> TargetMemory:
    """Frozen target: weights (FP8 linears keep bf16 embeddings/norms) and no-grad forward.

    shards > 1 (target_sharding=fsdp): each GPU keeps 1/shards of the decoder layers'
    linears, the embeddings, norms and lm_head whole (distributed.apply_target_sharding),
    and the forward holds two all-gathered layers: the one running and the next one
    being gathered.
    """
    lin_bytes = 1 if fp8 else 2
    lin = target.decoder_linear_params
    other = target.total_params - lin
    # FP8 converts the aligned, non-router linears (target/fp8.py); the others stay bf16.
    # Its per-channel fp32 scales are 4 bytes per output row: left out (under 0.1%).
    fp8_params = target.decoder_fp8_params if fp8 else 0
    weights = (fp8_params + 2 * (lin - fp8_params)) / shards + 2 * other
    gathered = 0.0
    if shards > 1:
        gathered = 2.0 * lin_bytes * max(layer.linear_params for layer in target.layers)
    h, inter = target.hidden_size, target.intermediate_size
    m = min(micro_tokens, shape.target_padded_tokens)
    # One layer at a time: residual, norm output and the wider of MLP / attention / GDN.
    # FP8: the down projection's input also exists as its e4m3 copy (1 byte a value).
    mlp = 2 * m * (3 * inter + 2 * h) + (m * inter if fp8 else 0)
    attn = 2 * m * (3 * target.num_heads * target.head_dim + 2 * h) + shape.target_attn_pairs
    gdn = 4 * m * target.linear_value_heads * (6 * max(target.linear_key_dim, 1) + 128)
    layer = max(mlp, attn, gdn)
    # Tapped outputs of the micro-batch, their concatenation and the packed copies.
    per_tok = 2 * n_tapped * h
    features = 3.0 * per_tok * shape.ctx_len + (2 * h * shape.ctx_len if need_final else 0)
    lm_chunk = 2.0 * min(4096, shape.rows) * target.vocab_size if need_final else 0.0
    return TargetMemory(
        float(weights), float(gathered + layer + max(per_tok * m, lm_chunk) + features), features
    )
