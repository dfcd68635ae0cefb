"""Attention kernels at the regeneration engine's shapes: which SDPA backend to use.

The engine's decode step attends one new token per row to a fixed-length cache through an
explicit row mask (every row has its own length); SmolLM2-135M's 9 query heads share 3
key/value heads, so a step is q [rows, 3, 3, 64] against k/v [rows, 3, L, 64]
(data/grouped_decode.py). Its prefill attends [k, 9, W, 64] with a causal-and-padding mask.
This times each SDPA backend that accepts a mask (cuDNN, memory-efficient, math) and a plain
matmul-softmax-matmul, eagerly, with CUDA events, per call; a decode step makes one call per
layer (30 for SmolLM2).

    python benchmarks/decode_attention_speed.py --out benchmarks/results/decode_attention_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    s = s.float().masked_fill(~m, float("-inf")).softmax(-1).to(q.dtype)
    return s @ v


def _time(fn: Callable[[], Any], iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _inputs(kind: str, rows: int, length: int, dev: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    if kind == "decode":  # [rows, Hkv, G, D] against [rows, Hkv, L, D]; a random length per row
        q = torch.randn(rows, 3, 3, 64, device=dev, dtype=bf, generator=g)
        k = torch.randn(rows, 3, length, 64, device=dev, dtype=bf, generator=g)
        pos = torch.randint(0, length, (rows,), device=dev, generator=g)
        mask = (torch.arange(length, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
    else:  # prefill: [k, H, W, D], causal over left-padded rows
        q = torch.randn(rows, 9, length, 64, device=dev, dtype=bf, generator=g)
        k = torch.randn(rows, 9, length, 64, device=dev, dtype=bf, generator=g)
        pad = torch.randint(0, length // 2, (rows,), device=dev, generator=g)
        cols = torch.arange(length, device=dev)
        causal = cols[None, :] <= cols[:, None]
        real = cols[None, :] >= pad[:, None]
        own = cols[None, :] == cols[:, None]  # a padding column sees itself: no empty row
        mask = ((causal[None] & real[:, None, :]) | own[None])[:, None]
    return q, k, torch.randn_like(k), mask


def _one(kind: str, rows: int, length: int, iters: int) -> dict[str, Any]:
    q, k, v, m = _inputs(kind, rows, length, "cuda")
    row: dict[str, Any] = {"kind": kind, "rows": rows, "length": length}
    ref = _explicit(q, k, v, m).float()
    for name, backend in BACKENDS.items():

        def call(b: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel([b]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

        try:
            err = (call().float() - ref).abs().max().item()
            row[name] = {"ms": round(_time(call, iters), 4), "max_abs_diff": round(err, 4)}
        except RuntimeError as e:  # a backend that refuses these inputs
            row[name] = {"ms": None, "why": str(e).splitlines()[0][:160]}
    row["explicit"] = {"ms": round(_time(lambda: _explicit(q, k, v, m), iters), 4)}
    kv_bytes = 2 * k.numel() * k.element_size()
    row["kv_read_ms_at_4.8TB/s"] = round(kv_bytes / 4.8e12 * 1e3, 4)
    return row


def measure(shapes: list[tuple[str, int, int]], iters: int) -> list[dict[str, Any]]:
    out = []
    for kind, rows, length in shapes:
        out.append(_one(kind, rows, length, iters))
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    shapes = [("decode", r, n) for r in (256, 1024) for n in (256, 1024, 2048)]
    shapes += [("decode", 512, 4096), ("prefill", 128, 256), ("prefill", 32, 1024)]
    shapes += [("prefill", 16, 2048)]
    rows = measure(shapes, args.iters)
    names = [*BACKENDS, "explicit"]
    print(
        f"{'kind':8} {'rows':>5} {'len':>5} " + " ".join(f"{n:>10}" for n in names) + "   (ms/call)"
    )
    for r in rows:
        cells = [r[n]["ms"] for n in names]
        print(
            f"{r['kind']:8} {r['rows']:>5} {r['length']:>5} "
            + " ".join(f"{'n/a' if c is None else c:>10}" for c in cells)
        )
    best = {}
    for kind in ("decode", "prefill"):
        total = {n: 0.0 for n in BACKENDS}
        for r in rows:
            if r["kind"] == kind:
                for n in BACKENDS:
                    total[n] += r[n]["ms"] if r[n]["ms"] is not None else float("inf")
        best[kind] = min(total, key=lambda n: total[n])
    result = {
        "hardware": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "shapes": rows,
        "fastest_backend": best,
        "note": "ms per call, eager, CUDA events; a SmolLM2 decode step makes 30 calls",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("fastest:", best)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
