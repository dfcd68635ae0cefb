"""The frozen target in FP8 (`target.precision: fp8`): its large linears quantized once.

Shape legend: M = rows of an activation (tokens), K = in features, N = out features.

- Weights: each row of W [N, K] (one output channel) becomes float8 e4m3 with its own
  scale amax / 448, computed once at load; the bf16 weight is then freed, so the
  converted linears take half the memory (plus 4 bytes a channel for the scales).
- Activations: each token (row of x [M, K]) gets its own scale amax / 448 at run time,
  so one outlier token does not crush the resolution of the others.
- Matmul: `torch._scaled_mm(x_q [M, K] row-major, W_q^T [K, N] column-major,
  scale_a [M, 1], scale_b [1, N], out_dtype=bf16)`: FP8 tensor cores, fp32
  accumulation, the two scales applied in the epilogue. Fast accumulation stays off:
  the target's outputs are the drafter's labels, and accuracy comes first.
- What stays bf16: only `nn.Linear` modules inside the decoder layers convert. The
  embedding, norms, the attention and Gated DeltaNet kernels (and DeltaNet's conv),
  lm_head and MoE routers are untouched, and every FP8 linear returns bf16, so the
  tapped hidden states and the label logits are bf16 tensors as before. A linear
  with K or N not a multiple of 16 (what `_scaled_mm` requires) stays bf16 and is
  counted in the report.

Why `torch._scaled_mm` rather than torchao's float8 inference path: no extra
dependency (the GPU machines reach no package registry), the choice of which modules
convert stays ours, and CUDA-graph and compile behaviour is a few lines we can read.
torchao's row-wise float8 inference dispatches to the same `_scaled_mm` kernel, so the
matmul speed would not differ; whether its fused quantization is faster is left to a
measurement (benchmarks/gpu/online_step.sh has the leg to compare against).

CUDA graphs and compile: quantizing is an amax, a divide, a clamp and a cast, device
ops whose shapes follow the input's: no host sync, no data-dependent shape, so the fast
step captures it like any other op. On CUDA the quantize + matmul pair runs through
one `torch.compile` with dynamic shapes (one compile for every linear and token count),
which fuses the quantization into one kernel in front of the matmul.

Requirements: a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell).
`fp8_mode` probes the device once: row-wise scaled matmuls when the PyTorch build has
them there; else per-tensor FP8 matmuls with unit scales and the row and column scales
applied to the bf16 output (some cuBLAS versions lack row-wise scaling on RTX
Blackwell, sm_120); else a DFlashError naming the requirement.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from dflash_trainer.errors import DFlashError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
"""448: the largest finite e4m3 value. Values are clamped to it before the cast, so
saturation does not depend on how a given kernel's cast treats overflow (e4m3fn has no inf)."""
AMAX_FLOOR = 1e-12
"""A zero row gets this amax: scale > 0, the row quantizes to exact zeros, no 0/0."""
ALIGN = 16
"""`_scaled_mm` needs K and N to be multiples of 16."""
MIN_CAPABILITY = (8, 9)
ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})
"""Leaf names of MoE routers: a routing decision flipped by rounding changes which expert
runs, so routers stay bf16 (they are small)."""
REQUIREMENT = (
    "target.precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, "
    "Hopper, Blackwell) for its FP8 matmuls (torch._scaled_mm)"
)

Fp8Mode = Literal["rowwise", "tensorwise"]


# ------------------------------------------------------------------ quantization math


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` [..., K] as float8 e4m3 with its own fp32 scale [..., 1].

    x ~= q * scale with scale = amax(|row|) / 448: the largest magnitude of a row maps
    to 448 (no headroom is needed: nothing is accumulated in e4m3).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of `quantize_rows`' output."""
    return q.float() * scale


def reference_matmul(
    x_MK: torch.Tensor, w_q_NK: torch.Tensor, w_scale_1N: torch.Tensor
) -> torch.Tensor:
    """What the FP8 linear computes, emulated in fp32: x quantized per token, times the
    dequantized weight. The dense reference of the `_scaled_mm` path (tests, probe)."""
    q, s = quantize_rows(x_MK)
    return dequantize_rows(q, s) @ (w_q_NK.float() * w_scale_1N.t()).t()


def _scaled_matmul(
    x_MK: torch.Tensor, w_q_NK: torch.Tensor, w_scale_1N: torch.Tensor, rowwise: bool
) -> torch.Tensor:
    """x [M, K] (bf16) times the FP8 weight: bf16 [M, N]."""
    q, s = quantize_rows(x_MK)
    if rowwise:
        return torch._scaled_mm(
            q, w_q_NK.t(), scale_a=s, scale_b=w_scale_1N, out_dtype=torch.bfloat16
        )
    one = torch.ones((), dtype=torch.float32, device=x_MK.device)
    raw = torch._scaled_mm(q, w_q_NK.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return (raw.float() * s * w_scale_1N).to(torch.bfloat16)


@functools.cache
def _compiled_matmul() -> Any:
    # dynamic=True: one graph for every (M, K, N); a static first compile would be
    # followed by a recompile at the second token count anyway.
    return torch.compile(_scaled_matmul, dynamic=True, fullgraph=True)


# ---------------------------------------------------------------------------- module


class FP8Linear(nn.Module):
    """A frozen nn.Linear whose matmul runs in FP8 (weights quantized per output channel
    once, activations per token at each call); bias and output in bf16."""

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight_fp8: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        mode: Fp8Mode = "rowwise",
        compiled: bool = True,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_fp8.shape
        self.register_buffer("weight_fp8", weight_fp8)
        self.register_buffer("weight_scale", weight_scale.reshape(1, -1).contiguous())
        self.register_buffer("bias", bias)
        self.mode: Fp8Mode = mode
        self.compiled = compiled

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls, linear: nn.Linear, mode: Fp8Mode = "rowwise", compiled: bool = True
    ) -> FP8Linear:
        q, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        return cls(q, scale, bias, mode, compiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_MK = x.reshape(-1, self.in_features)
        if x_MK.dtype != torch.bfloat16:
            x_MK = x_MK.to(torch.bfloat16)
        rowwise = self.mode == "rowwise"
        # Inside a region torch.compile is already tracing, the plain function is traced
        # (and fused) with the rest.
        own_compile = self.compiled and x.is_cuda and not torch.compiler.is_compiling()
        fn = _compiled_matmul() if own_compile else _scaled_matmul
        out = fn(x_MK, self.weight_fp8, self.weight_scale, rowwise)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, mode={self.mode}"
        )


# ---------------------------------------------------------------- device requirement


def check_fp8_device(device: str | torch.device) -> None:
    """A DFlashError naming the requirement unless `device` is a CUDA GPU of sm_89+."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise DFlashError(
            f"{REQUIREMENT}; the target is on {dev.type}: use target.precision=bf16 there "
            "(dflash eval: --target-precision bf16)"
        )
    if not torch.cuda.is_available():
        raise DFlashError(f"{REQUIREMENT}; no CUDA GPU is visible to this process")
    cap = torch.cuda.get_device_capability(dev)
    if cap < MIN_CAPABILITY:
        raise DFlashError(
            f"{REQUIREMENT}; {torch.cuda.get_device_name(dev)} is compute capability "
            f"{cap[0]}.{cap[1]}: use target.precision=bf16 on this GPU"
        )


def _probe_error(fn: Any, args: tuple[Any, ...], want: torch.Tensor, device: str) -> str | None:
    """None when `fn(*args)` runs on `device` and matches `want`, else what went wrong."""
    try:
        got = fn(*args)
        torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # a missing kernel, a cuBLAS status, a compiler error
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    err = ((got.float() - want).norm() / want.norm()).item()
    return None if err < 1e-2 else f"relative error {err:.3g} against the fp32 emulation"


@functools.cache
def _probe(device: str) -> tuple[Fp8Mode, bool]:
    """Which scaled matmul this PyTorch runs correctly on `device`, and whether its compiled
    form (the one the FP8 linears call) builds and agrees too."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(32, 64, generator=g).to(device, torch.bfloat16)
    w_q, w_s = quantize_rows(torch.randn(48, 64, generator=g).to(device))
    w_s = w_s.reshape(1, -1).contiguous()
    want = reference_matmul(x, w_q, w_s)
    errors = []
    for mode in ("rowwise", "tensorwise"):
        args = (x, w_q, w_s, mode == "rowwise")
        why = _probe_error(_scaled_matmul, args, want, device)
        if why is not None:
            errors.append(f"{mode}: {why}")
            continue
        why = _probe_error(_compiled_matmul(), args, want, device)
        if why is not None:
            print(
                f"[dflash] target FP8: the compiled quantization does not build here ({why}); "
                "the FP8 linears quantize eagerly (a few more kernels each)",
                file=sys.stderr,
                flush=True,
            )
        return mode, why is None
    raise DFlashError(
        f"{REQUIREMENT}; PyTorch {torch.__version__} has no working FP8 matmul on "
        f"{torch.cuda.get_device_name(device)} ({'; '.join(errors)}): use "
        "target.precision=bf16, or a newer PyTorch"
    )


def _probed(device: str | torch.device) -> tuple[Fp8Mode, bool]:
    dev = torch.device(device)
    check_fp8_device(dev)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _probe(f"cuda:{index}")


def fp8_mode(device: str | torch.device) -> Fp8Mode:
    """The scaled-matmul flavour for `device` (probed once), or a DFlashError."""
    return _probed(device)[0]


# ------------------------------------------------------------------------ conversion


@dataclass
class Fp8Report:
    """What `quantize_linears` converted and what it left in bf16 (and why)."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """Module name -> why it stays bf16."""
    bytes_before: int = 0
    """Weight (+ bias) bytes of the converted linears before."""
    bytes_after: int = 0
    """... and after (FP8 weights, fp32 scales, bf16 bias)."""
    modes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        line = (
            f"target FP8: {len(self.converted)} linears converted "
            f"({_size(self.bytes_before)} -> {_size(self.bytes_after)}, "
            f"{'/'.join(self.modes) or '-'} scaled matmuls)"
        )
        if self.skipped:
            reasons: dict[str, int] = {}
            for why in self.skipped.values():
                reasons[why] = reasons.get(why, 0) + 1
            line += "; kept bf16: " + ", ".join(f"{n} ({why})" for why, n in reasons.items())
        return line


def skip_reason(name: str, linear: nn.Linear) -> str | None:
    """Why the linear `name` stays bf16, or None when it converts."""
    if name.rpartition(".")[2] in ROUTER_NAMES:
        return "MoE router"
    if not linear.weight.dtype.is_floating_point or linear.weight.element_size() < 2:
        return f"weight dtype {linear.weight.dtype}"
    if linear.in_features % ALIGN or linear.out_features % ALIGN:
        return "in/out features not multiples of 16"
    return None


def _plan(model: nn.Module, layers: Iterable[nn.Module], skipped: dict[str, str]) -> list[str]:
    """Names of the linears inside `layers` that convert; the others into `skipped`."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    names = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and id(m) in inside:
            why = skip_reason(name, m)
            if why is None:
                names.append(name)
            else:
                skipped[name] = why
    return names


@torch.no_grad()
def quantize_linears(
    model: nn.Module,
    layers: Iterable[nn.Module],
    mode: Fp8Mode | None = None,
    compiled: bool = True,
) -> Fp8Report:
    """Replace every nn.Linear inside `layers` (the decoder layers of `model`) that FP8
    can run by an FP8Linear, on the linear's own device; the rest stays as it is.

    `mode` None: probed per device (`fp8_mode`: the device requirement is checked
    there; where the compiled quantization does not build, the linears run it eagerly). Linears are converted one at a time and each bf16 weight is dropped as soon
    as its FP8 copy exists, so the peak is the bf16 model plus one layer's weights.
    """
    report = Fp8Report()
    # Names only: a list of the modules would keep every bf16 weight alive to the end.
    names = _plan(model, layers, report.skipped)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        lin = getattr(parent, leaf)
        dev_mode, dev_compiled = (mode, compiled) if mode else _probed(lin.weight.device)
        new = FP8Linear.from_linear(lin, dev_mode, compiled and dev_compiled)
        report.bytes_before += _bytes(lin.weight) + (
            _bytes(lin.bias) if lin.bias is not None else 0
        )
        report.bytes_after += sum(_bytes(b) for b in new.buffers())
        setattr(parent, leaf, new)
        del lin
        report.converted.append(name)
        if dev_mode not in report.modes:
            report.modes.append(dev_mode)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the freed bf16 weights back to the other users of the GPU
    return report


@torch.no_grad()
def quantize_onto(
    model: nn.Module,
    layers: Iterable[nn.Module],
    device: str | torch.device,
    mode: Fp8Mode | None = None,
    compiled: bool = True,
) -> Fp8Report:
    """Move `model` (on the host) to `device` a decoder layer at a time, each layer's linears
    quantized as soon as it arrives, then the rest (embedding, norm, lm_head).

    Moving the whole bf16 model first and quantizing there would make the bf16 weights the
    GPU's peak (54 GB for a 27B target, more than its training step with FP8 weights needs);
    this way the GPU holds the FP8 layers done so far plus one bf16 layer.
    """
    total = Fp8Report()
    for layer in layers:
        layer.to(device)
        part = quantize_linears(model, [layer], mode, compiled)
        total.converted += part.converted
        total.skipped.update(part.skipped)
        total.bytes_before += part.bytes_before
        total.bytes_after += part.bytes_after
        total.modes += [m for m in part.modes if m not in total.modes]
    model.to(device)
    return total


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
