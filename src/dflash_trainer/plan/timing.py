"""Seconds per step from FLOPs, bytes and the card's rates: a roofline per stage.

Every stage is `max(matmul FLOPs / (peak x matmul efficiency), bytes / (bandwidth x
bandwidth efficiency))` summed with the memory-bound work that no matmul hides
(elementwise ops, the loss's fp32 logits, the optimizer). Which rate applies:
- an FP8 target's converted linears (target/fp8.py) run at the FP8 peak times the FP8
  efficiency, everything else at bf16; each converted linear first quantizes its input per
  token (`FP8_QUANT_BYTES` of traffic per input value, one more kernel launch);
- the chunked gated-delta-rule scan runs at `SCAN_EFFICIENCY` of the matmul rate (its
  small chunk matmuls do not fill the tensor cores; calibrated on the H200, below);
- fused attention executes 2.5x its forward FLOPs in backward (score recompute).
Byte counts for elementwise work are per token and per layer, read off the code:
norms upcast to fp32, residual adds, SwiGLU, and for the loss about 40 bytes per logit
(bf16 logits written, upcast, two log-softmax passes, argmax, exp, the bf16 cast back)
or 110 for KL (the target's log-probabilities and the KL terms on top).

Pairs placement: the trainer runs the target stage of step i+1 (forward, anchors,
transfer) in a background thread while the drafter trains step i, so the step is the
max of the two sides (`overlap`); colocated, they alternate on one GPU and add up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dflash_trainer.plan.flops import Flops, TargetModel
from dflash_trainer.plan.hardware import Hardware

SCAN_EFFICIENCY = 0.01
"""Fraction of the matmul rate the linear-attention path reaches. Calibrated on the H200
(benchmarks/online_step_h200_202612.md, session 2): a random-weight Qwen3.6-27B forward
over 8,192 tokens took 958 ms where 0.5 predicted 572; the 386 ms gap is the 48 Gated
DeltaNet layers (fla 0.6.0 chunk kernels under transformers 5.17, no causal-conv1d: many
small fp32 Triton kernels), i.e. ~1% of the matmul rate on their 3.1 TFLOP."""
LOSS_BYTES_PER_LOGIT = {"ce": 40.0, "kl": 110.0, "lk": 110.0}
FP8_QUANT_BYTES = 3.0
"""Per activation value an FP8 linear quantizes: the bf16 read (2) and the e4m3 write (1)
of the compiled quantization kernel (its row amax and the cast share one pass)."""
FP8_QUANT_OPS = 1
"""Kernels an FP8 linear adds in front of its matmul (the compiled quantization)."""
HOST_OVERHEAD_S = 0.001
"""Per step on the host, fixed: mask building, Python. Calibrated with HOST_PER_DOC_S on
two SmolLM2 steps measured on the H200 (29 and 58 documents per step)."""
HOST_PER_DOC_S = 0.3e-3
"""Per document per step on the host: anchor sampling, position ids, packing."""
DDP_BUCKET_BYTES = 25e6
"""DDP's default bucket: the last one cannot overlap with backward."""
LAUNCH_S = 20e-6
"""Host time to dispatch one eager op (Python + launch). A stage can run no faster than its
op count times this: what bounds small models (SmolLM2-135M). Calibrated on the H200: a
SmolLM2 step made ~1,600 kernel launches for ~59 ms of host time (torch.profiler)."""
TARGET_OPS_PER_LAYER = {"full_attention": 30, "sliding_attention": 30, "linear_attention": 60}
DRAFTER_OPS_PER_LAYER = 110
"""Forward (~35 ops: norms, projections, RoPE, attention, MLP) plus backward (~2x)."""
DRAFTER_FIXED_OPS = 80
"""Outside the layers: feature projection, block embeddings, final norm, gathers."""
LOSS_OPS_PER_CHUNK = 60
"""One chunk of rows through the lm_head and the loss, forward and its backward."""


@dataclass(frozen=True)
class Rates:
    """Effective rates after efficiency (and calibration) factors."""

    bf16: float
    fp8: float
    bandwidth: float
    link: float

    @staticmethod
    def of(hw: Hardware) -> Rates:
        return Rates(
            bf16=hw.bf16_tflops * 1e12 * hw.matmul_efficiency,
            fp8=hw.fp8_tflops * 1e12 * hw.fp8_efficiency,
            bandwidth=hw.bandwidth_gbs * 1e9 * hw.bandwidth_efficiency,
            link=hw.link_gbs * 1e9 * hw.link_efficiency,
        )


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one step, by stage (one data-parallel rank)."""

    target: float
    transfer: float
    drafter_forward: float
    loss: float
    drafter_backward: float
    allreduce: float
    allreduce_exposed: float
    optimizer: float
    host: float

    @property
    def drafter(self) -> float:
        """What the trainer logs as drafter_time_s: forward, loss, backward (+ DDP wait)."""
        return self.drafter_forward + self.loss + self.drafter_backward + self.allreduce_exposed

    @property
    def target_side(self) -> float:
        """What the trainer logs as target_time_s: target forward, anchors, transfer."""
        return self.target + self.host + self.transfer

    def step(self, overlap: bool) -> float:
        """Wall time of a step; `overlap`: the target side runs next to the drafter side."""
        drafter_side = self.drafter + self.optimizer
        if overlap:
            return max(self.target_side, drafter_side)
        return self.target_side + drafter_side

    def to_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["drafter"] = self.drafter
        return d


def target_time(
    target: TargetModel,
    flops: Flops,
    padded_tokens: float,
    layers_run: int,
    micro_batches: float,
    rates: Rates,
    fp8: bool,
) -> float:
    run = target.layers[:layers_run]
    lin_params = sum(layer.linear_params for layer in run)
    fp8_params = sum(layer.fp8_params for layer in run) if fp8 else 0
    fp8_flops = 2.0 * padded_tokens * fp8_params
    linear = (flops.total("linear") - fp8_flops) / rates.bf16 + fp8_flops / rates.fp8
    # Each micro-batch reads every weight once: bound below by bandwidth.
    weight_read = micro_batches * (2 * lin_params - fp8_params) / rates.bandwidth
    other = flops.total("attention") / rates.bf16
    other += flops.total("scan") / (rates.bf16 * SCAN_EFFICIENCY)
    other += flops.total("lm_head") / rates.bf16
    # Norms, residual adds, SwiGLU, rotary/gating, bf16: ~28 H + 6 I bytes per token-layer.
    per_token_layer = 28 * target.hidden_size + 6 * target.intermediate_size
    elementwise = padded_tokens * layers_run * per_token_layer / rates.bandwidth
    ops = sum(TARGET_OPS_PER_LAYER.get(layer.kind, 40) for layer in run)
    if fp8:
        quant_values = padded_tokens * sum(layer.fp8_inputs for layer in run)
        elementwise += FP8_QUANT_BYTES * quant_values / rates.bandwidth
        ops += FP8_QUANT_OPS * sum(layer.fp8_linears for layer in run)
    dispatch = micro_batches * ops * LAUNCH_S
    return max(max(linear, weight_read) + other + elementwise, dispatch)


def drafter_times(
    fwd: Flops,
    bwd: Flops,
    loss: Flops,
    saved_bytes: float,
    logits: float,
    loss_kind: str,
    params: int,
    rates: Rates,
    data_parallel: int,
    unfused_score_bytes: float = 0.0,
    num_layers: int = 1,
    loss_chunks: int = 1,
) -> tuple[float, float, float, float, float, float]:
    """(forward, loss, backward, optimizer, allreduce, exposed allreduce) seconds."""
    # Elementwise traffic scales with what the forward saves: each saved byte is written
    # once and read once forward, and read about twice more by the backward.
    forward = fwd.total() / rates.bf16 + 2 * saved_bytes / rates.bandwidth
    backward = bwd.total() / rates.bf16 + 2 * saved_bytes / rates.bandwidth
    if unfused_score_bytes:
        # The math kernel writes and reads [Hq, Q, KV] fp32 scores: ~3 passes forward, ~5 back.
        forward += 3 * unfused_score_bytes / rates.bandwidth
        backward += 5 * unfused_score_bytes / rates.bandwidth
    # Dispatch floors: a third of a layer's ops run forward, two thirds backward.
    ops = DRAFTER_FIXED_OPS + num_layers * DRAFTER_OPS_PER_LAYER
    forward = max(forward, ops * LAUNCH_S / 3)
    backward = max(backward, ops * LAUNCH_S * 2 / 3)
    loss_s = loss.total() / rates.bf16 + LOSS_BYTES_PER_LOGIT[loss_kind] * logits / rates.bandwidth
    loss_s = max(loss_s, loss_chunks * LOSS_OPS_PER_CHUNK * LAUNCH_S)
    # Fused AdamW: read p, g, m, v and write p, m, v (28 B/param); clipping reads and
    # scales the grads (12 B/param).
    optimizer = 40.0 * params / rates.bandwidth
    allreduce = exposed = 0.0
    if data_parallel > 1:
        ring = 2 * (data_parallel - 1) / data_parallel
        allreduce = ring * 4.0 * params / rates.link
        last_bucket = ring * DDP_BUCKET_BYTES / rates.link
        exposed = max(allreduce - backward, last_bucket)
    return forward, loss_s, backward, optimizer, allreduce, exposed
