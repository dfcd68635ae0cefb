"""The target's linear layers in bf16 and through `target.fp8.FP8Linear`, at a real target's
shapes: ms per call and TFLOP/s for bf16 `nn.Linear`, the FP8 linear with its per-token
quantization compiled (what the trainer runs) and eager, and the bare row-wise
`_scaled_mm` on pre-quantized inputs (the matmul alone); with the relative error of each
FP8 output against the bf16 one.

    python benchmarks/fp8_matmul_speed.py --tokens 8192 --out fp8_matmul_speed.json

Shapes (--model): qwen3.6-27b: attention q (with its output gate) / k / v / o, the
Gated DeltaNet in_proj_qkv / in_proj_z / out_proj, and the MLP gate / up / down of
hidden 5120 and intermediate 17408; smollm2-135m: hidden 576, intermediate 1536.
One CUDA GPU; random data (speed does not depend on the values, errors are for random
weights and activations, not a real model's).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from torch import nn

from dflash_trainer.target.fp8 import FP8Linear, fp8_mode, quantize_rows

SHAPES = {
    # name: (in_features K, out_features N)
    "qwen3.6-27b": {
        "q_proj (+gate)": (5120, 2 * 24 * 256),
        "k_proj / v_proj": (5120, 4 * 256),
        "o_proj": (24 * 256, 5120),
        "in_proj_qkv": (5120, 2 * 16 * 128 + 48 * 128),
        "in_proj_z": (5120, 48 * 128),
        "out_proj": (48 * 128, 5120),
        "gate_proj / up_proj": (5120, 17408),
        "down_proj": (17408, 5120),
    },
    "smollm2-135m": {
        "q_proj / o_proj": (576, 576),
        "k_proj / v_proj": (576, 192),
        "gate_proj / up_proj": (576, 1536),
        "down_proj": (1536, 576),
    },
}


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def one_shape(k: int, n: int, tokens: int, iters: int, mode: str) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(0)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        lin.weight.normal_(0, k**-0.5, generator=g)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
    compiled = FP8Linear.from_linear(lin, mode, compiled=True)
    eager = FP8Linear.from_linear(lin, mode, compiled=False)
    xq, xs = quantize_rows(x)
    w_t, w_s = compiled.weight_fp8.t(), compiled.weight_scale
    flop = 2.0 * tokens * k * n
    with torch.no_grad():
        ref = lin(x).float()
        out: dict[str, float] = {}
        for name, fn in (
            ("bf16", lambda: lin(x)),
            ("fp8_compiled", lambda: compiled(x)),
            ("fp8_eager", lambda: eager(x)),
            (
                "scaled_mm_only",
                lambda: torch._scaled_mm(
                    xq, w_t, scale_a=xs, scale_b=w_s, out_dtype=torch.bfloat16
                ),
            ),
        ):
            if name == "scaled_mm_only" and mode != "rowwise":
                continue
            ms = time_ms(fn, iters)
            out[f"{name}_ms"] = ms
            out[f"{name}_tflops"] = flop / ms / 1e9
        for name, layer in (("fp8_compiled", compiled), ("fp8_eager", eager)):
            err = (layer(x).float() - ref).norm() / ref.norm()
            out[f"{name}_rel_err"] = float(err)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="qwen3.6-27b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args()
    mode = fp8_mode("cuda")
    rows = {}
    for name, (k, n) in SHAPES[args.model].items():
        rows[name] = r = one_shape(k, n, args.tokens, args.iters, mode)
        print(
            f"{name:22} K={k:6} N={n:6}  bf16 {r['bf16_ms']:.3f} ms ({r['bf16_tflops']:.0f} TFLOP/s)"
            f"  fp8 compiled {r['fp8_compiled_ms']:.3f} ms ({r['fp8_compiled_tflops']:.0f})"
            f"  eager {r['fp8_eager_ms']:.3f}"
            + (f"  matmul only {r['scaled_mm_only_ms']:.3f}" if "scaled_mm_only_ms" in r else "")
            + f"  rel err {r['fp8_compiled_rel_err']:.4f}",
            flush=True,
        )
    total = {
        key: sum(r[f"{key}_ms"] for r in rows.values())
        for key in ("bf16", "fp8_compiled", "fp8_eager")
    }
    print(
        f"sum over shapes: bf16 {total['bf16']:.2f} ms, fp8 compiled {total['fp8_compiled']:.2f} "
        f"({total['bf16'] / total['fp8_compiled']:.2f}x), eager {total['fp8_eager']:.2f} "
        f"({total['bf16'] / total['fp8_eager']:.2f}x)"
    )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "mode": mode,
        "model": args.model,
        "tokens": args.tokens,
        "shapes": {name: list(kn) for name, kn in SHAPES[args.model].items()},
        "per_shape": rows,
        "sum_ms": total,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
