"""Drafter training step at a real drafter geometry: fused vs unfused vs naive (GPU).

Measures, in one process and against the bf16 matmul rate measured in the same run:
- `compiled`: the project's path (block-sparse BlockMask, torch.compile'd FlexAttention,
  fused chunked lm_head + loss), eager drafter layers;
- `compiled+layers`: the same with every drafter layer torch.compile'd too;
- `eager-flex`: FlexAttention without compile (materialises scores: the unfused backward);
- `naive`: one drafter forward per document with dense-mask SDPA (no packing).
Per variant: time from start to the first finished step (compile included), median
step time (forward + loss + backward, optimizer step excluded), model TFLOP/s and
peak memory. Prints a table and writes JSON.

    python benchmarks/drafter_step.py --recipe qwen3.6-27b --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from dflash_trainer.config import load_config
from dflash_trainer.core.anchors import sample_anchors
from dflash_trainer.core.drafter import DFlashDrafter, flex_attention_eager, sdpa_attention
from dflash_trainer.core.geometry import resolve_drafter_spec
from dflash_trainer.core.masks import build_intervals
from dflash_trainer.core.packing import Pack, pack_documents
from dflash_trainer.target.configs import load_target_config
from dflash_trainer.train.step import Blocks, StepSettings, drafter_loss

DEV = torch.device("cuda")


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if DEV.type == "cuda" else float("nan")


def matmul_rate(n: int = 8192, reps: int = 10) -> float:
    if DEV.type != "cuda":
        return float("nan")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def model_flops(spec: Any, pack: Pack, blocks: Blocks) -> float:
    """Forward + backward model FLOPs (no recompute), attention over visible pairs only."""
    t, q = pack.length, blocks.anchors.num_anchors * spec.block_size
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    hq, hkv = spec.num_attention_heads, spec.num_key_value_heads
    fwd = 2 * t * spec.num_context_features * h  # fc
    bwd = fwd  # fc weight grad only
    for kind in spec.layer_types:
        w = spec.sliding_window if kind == "sliding_attention" else None
        iv = build_intervals(blocks.anchors, pack.length, w)
        pairs = float((iv.ctx_hi_Q - iv.ctx_lo_Q).sum() + (iv.blk_hi_Q - iv.blk_lo_Q).sum())
        lin = (
            2 * q * h * hq * d + 4 * (t + q) * h * hkv * d + 2 * q * hq * d * h + 6 * q * h * inter
        )
        att = 4 * hq * d * pairs
        fwd += lin + att
        bwd += 2 * (lin + att)
    rows = float(blocks.anchors.slot_valid_NB.sum())
    lm = 2 * 2 * rows * h * spec.vocab_size  # logits + hidden grad (fused, no weight grad)
    return fwd + bwd + lm


def make_blocks(spec: Any, docs: list[int], max_anchors: int, seed: int = 0) -> tuple[Pack, Blocks]:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, spec.vocab_size, (n,), generator=g) for n in docs]
    masks = [torch.ones(n, dtype=torch.bool) for n in docs]
    for m in masks:
        m[: len(m) // 8] = False  # a prompt per document
    pack = pack_documents(ids, masks, pad_multiple=128)
    anchors = sample_anchors(pack, max_anchors, spec.block_size, g, pad_multiple=8)
    feats = torch.randn(pack.length, spec.num_context_features, generator=g).to(torch.bfloat16)
    block_ids = torch.full((anchors.num_anchors, spec.block_size), spec.mask_token_id)
    block_ids[:, 0] = pack.input_ids_T[anchors.anchor_idx_N]
    labels = torch.randint(0, spec.vocab_size, block_ids.shape, generator=g)
    dev = DEV
    return pack, Blocks(
        pack.to(dev), anchors.to(dev), feats.to(dev), block_ids.to(dev), labels.to(dev), None
    )


def run_variant(
    name: str, spec: Any, args: argparse.Namespace, shared: dict[str, Any]
) -> dict[str, Any]:
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t_start = time.perf_counter()
    torch.manual_seed(0)
    model = DFlashDrafter(spec, noise_std=0.05).to(DEV).train()
    st = StepSettings(
        block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        max_anchors=args.anchors,
        labels="target",
        loss="ce",
        weighting="decay",
        gamma=4.0,
        dpace_alpha=0.5,
        chunk_rows=args.chunk_rows,
    )
    embed = shared["embed"]
    lm_head = shared["lm_head"]
    if name == "naive":
        per_doc = [
            make_blocks(spec, [n], args.anchors // len(args.docs), seed=i)
            for i, n in enumerate(args.docs)
        ]
        work = [(b, False, sdpa_attention) for _, b in per_doc]
        flops = sum(model_flops(spec, p, b) for p, b in per_doc)
    else:
        pack, blocks = shared["pack"], shared["blocks"]
        flops = model_flops(spec, pack, blocks)
        if name.startswith("compiled"):
            attn = torch.compile(flex_attention_eager, dynamic=False)
            if name == "compiled+layers":
                for i, layer in enumerate(model.layers):
                    model.layers[i] = torch.compile(layer, dynamic=False)
        else:
            attn = flex_attention_eager
        work = [(blocks, True, attn)]

    def step() -> float:
        total = 0.0
        for b, flex, attn_fn in work:
            res = drafter_loss(
                model,
                b,
                embed,
                lm_head,
                st,
                attn_fn=attn_fn,
                use_flex=flex,
                autocast_dtype=torch.bfloat16 if DEV.type == "cuda" else None,
            )
            res.loss.backward()
            total += float(res.loss.detach())
        model.zero_grad(set_to_none=True)
        return total

    out: dict[str, Any] = {"variant": name}
    try:
        step()
        sync()
        out["first_step_s"] = time.perf_counter() - t_start
        times = []
        for _ in range(args.iters):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out.update(
            step_ms=med * 1e3,
            step_ms_all=[round(x * 1e3, 2) for x in times],
            model_tflop=flops / 1e12,
            tflops=flops / med / 1e12,
            peak_gb=peak_gb(),
        )
    except torch.OutOfMemoryError as e:
        out.update(error="OOM", peak_gb=peak_gb(), detail=str(e)[:200])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="qwen3.6-27b")
    ap.add_argument("--docs", type=int, nargs="+", default=[2048, 2048, 2048, 2048])
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--chunk-rows", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default="compiled,compiled+layers,naive,eager-flex")
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--override", nargs="*", default=[], help="config overrides (smoke tests)")
    args = ap.parse_args()
    global DEV
    DEV = torch.device(args.device)
    cfg = load_config(recipe=args.recipe, overrides=args.override)
    spec = resolve_drafter_spec(cfg.drafter, load_target_config(cfg.target))
    rate = matmul_rate()
    torch.manual_seed(0)
    shared: dict[str, Any] = {
        "lm_head": (torch.randn(spec.vocab_size, spec.hidden_size, device=DEV) * 0.02).to(
            torch.bfloat16
        ),
    }
    emb_w = (torch.randn(spec.vocab_size, spec.hidden_size, device=DEV) * 0.02).to(torch.bfloat16)
    shared["embed"] = lambda ids: emb_w[ids]
    shared["pack"], shared["blocks"] = make_blocks(spec, args.docs, args.anchors)
    results = []
    for name in args.variants.split(","):
        r = run_variant(name, spec, args, shared)
        results.append(r)
        print(json.dumps(r), flush=True)
    info = {
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "matmul_tflops_bf16": rate,
        "recipe": args.recipe,
        "docs": args.docs,
        "anchors": args.anchors,
        "chunk_rows": args.chunk_rows,
        "results": results,
    }
    print(f"\nbf16 matmul {rate:.0f} TFLOP/s on {info['device']}")
    print(
        f"{'variant':18} {'first step s':>12} {'step ms':>9} {'TFLOP/s':>8} {'% matmul':>8} {'peak GB':>8}"
    )
    for r in results:
        if "error" in r:
            print(f"{r['variant']:18} {r['error']:>12} {'':>9} {'':>8} {'':>8} {r['peak_gb']:8.1f}")
            continue
        print(
            f"{r['variant']:18} {r['first_step_s']:12.1f} {r['step_ms']:9.1f} {r['tflops']:8.0f} "
            f"{100 * r['tflops'] / rate:7.0f}% {r['peak_gb']:8.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
