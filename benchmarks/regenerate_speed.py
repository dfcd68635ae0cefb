"""Regeneration speed: the static batch engine against today's HF batched path, one run.

Same model, same first-turn prompts (ShareGPT by default, or a prompts JSONL written by
benchmarks/sharegpt_prompts.py), same settings (greedy), one process. Useful tokens only: up
to and including the stop token. The engine leg answers every prompt; the HF leg, which is
slower, answers a strided subset (every k-th prompt, named in the JSON) so the script stays
within a few minutes on one GPU, and the engine's answers to that subset are compared with
HF's token for token (`greedy_identical_share`).

    python benchmarks/regenerate_speed.py --out benchmarks/results/regenerate_speed.json
    python benchmarks/regenerate_speed.py --device cpu --max-prompts 8 --max-new-tokens 8 \\
        --out /tmp/speed.json      # a tiny check that it runs
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.data.engine import StaticBatchEngine
from dflash_trainer.data.formats import read_records
from dflash_trainer.data.hf_generate import HFBatchGenerator
from dflash_trainer.data.loading import load_causal_lm, load_tokenizer
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.regenerate import GenerationSettings, cut_at_stop, stop_ids
from dflash_trainer.data.template import ChatTemplate


def first_turn_prompts(source: str, chat: ChatTemplate, n: int, max_tokens: int) -> list[list[int]]:
    prompts: list[list[int]] = []
    records = read_records(source, require_assistant=False)
    for c in itertools.islice((c for c in records if isinstance(c, Conversation)), 20 * n):
        first_user = next(i for i, m in enumerate(c.messages) if m["role"] == "user")
        ids = chat.prompt_ids(c.messages[: first_user + 1])
        if len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run_hf(
    gen: HFBatchGenerator, prompts: list[list[int]], batch: int, device: torch.device
) -> tuple[list[list[int]], float]:
    """Answers in the prompts' order and seconds, batched shortest first as regenerate does."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs: list[list[int]] = [[] for _ in prompts]
    _sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(order), batch):
        chunk = order[i : i + batch]
        for j, o in zip(chunk, gen.generate([prompts[j] for j in chunk])):
            outs[j] = o
    _sync(device)
    return outs, time.perf_counter() - t0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two answers differ (one ending early counts), or None."""
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_gaps(
    ref: Any, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]
) -> list[float]:
    """For each pair of answers that differ: at the first differing token, the gap between the
    two chosen tokens' logits in an fp32 forward of the shared prefix (`ref`: the model loaded
    in fp32, batch 1). A gap near 0 is a numerical tie that bf16 rounding decides either way."""
    dev = next(ref.parameters()).device
    gaps: list[float] = []
    with torch.inference_mode():
        for p, a, b in zip(prompts, ours, theirs):
            j = first_difference(a, b)
            if j is None or j >= min(len(a), len(b)):
                continue  # identical, or one stopped where the other went on (a length cut)
            ids = torch.tensor([p + b[:j]], device=dev)
            logits = ref(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
            gaps.append(abs(float(logits[a[j]] - logits[b[j]])))
    return gaps


def gap_summary(gaps: list[float]) -> dict[str, Any]:
    return {
        "answers_differing": len(gaps),
        "gap_le_0.05": sum(g <= 0.05 for g in gaps),
        "gap_le_0.1": sum(g <= 0.1 for g in gaps),
        "gap_le_0.25": sum(g <= 0.25 for g in gaps),
        "gap_le_0.5": sum(g <= 0.5 for g in gaps),
        "gap_max": round(max(gaps), 4) if gaps else None,
        "gap_median": round(sorted(gaps)[len(gaps) // 2], 4) if gaps else None,
        "note": "fp32 logit gap between the engine's and HF's token at the first differing "
        "position, prefix as HF generated it",
    }


def fp32_identity(
    ref: Any, prompts: list[list[int]], stops: list[int], pad: int, new: int
) -> dict[str, Any]:
    """Engine and HF `generate` on the fp32 model: greedy answers should match token for token."""
    settings = GenerationSettings("fp32", 0.0, 1.0, new)
    engine_outs = StaticBatchEngine(ref, settings, stops, pad, rows=64).generate(prompts)
    hf_outs = HFBatchGenerator(ref, settings, stops, pad, 64).generate(prompts)
    same = sum(
        cut_at_stop(a, stops)[0] == cut_at_stop(b, stops)[0] for a, b in zip(engine_outs, hf_outs)
    )
    return {"prompts": len(prompts), "new_tokens": new, "identical": same}


def warm_pass(
    engine: StaticBatchEngine, prompts: list[list[int]], stops: list[int], device: torch.device
) -> dict[str, Any]:
    """The same prompts again on the built engine: the speed of a long job, whose builds and
    compiles are paid once (the first pass's number includes them)."""
    before = copy.deepcopy(engine.stats)
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts)
    _sync(device)
    seconds = time.perf_counter() - t0
    after = engine.stats
    tokens = sum(cut_at_stop(o, stops)[2] for o in outs)
    steps = after.decode_steps - before.decode_steps
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "builds": after.builds - before.builds,
        "prefill_s": round(after.prefill_s - before.prefill_s, 3),
        "decode_s": round(after.decode_s - before.decode_s, 3),
        "host_s": round(after.host_s - before.host_s, 3),
        "decode_steps": steps,
        "ms_per_decode_step": round(1000 * (after.decode_s - before.decode_s) / max(1, steps), 3),
    }


def profile_engine(engine: StaticBatchEngine, prompts: list[list[int]]) -> dict[str, Any]:
    """A second pass over `prompts` (shapes already built) under the profiler: the kernels
    that take the GPU time, and how many kernels one decode step launches."""
    from torch.profiler import ProfilerActivity, profile

    steps0, prefills0 = engine.stats.decode_steps, engine.stats.prefills
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total_us = sum(e.device_time_total for e in events)
    return {
        "prompts": len(prompts),
        "decode_steps": engine.stats.decode_steps - steps0,
        "prefills": engine.stats.prefills - prefills0,
        "kernel_launches": sum(e.count for e in events),
        "gpu_ms": round(total_us / 1000, 2),
        "top_kernels": [
            {"name": e.key[:120], "calls": e.count, "ms": round(e.device_time_total / 1000, 2)}
            for e in events[:25]
        ],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    tok = load_tokenizer(args.model)
    model = load_causal_lm(args.model, args.device, args.dtype)
    device = next(model.parameters()).device
    chat = ChatTemplate.probe(tok)
    stops = stop_ids(tok, chat, model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    prompts = first_turn_prompts(args.input, chat, args.max_prompts, args.max_prompt_tokens)
    settings = GenerationSettings(args.model, 0.0, 1.0, args.max_new_tokens)

    engine = StaticBatchEngine(
        model,
        settings,
        stops,
        pad,
        rows=args.batch_size,
        refill_rows=args.refill_rows,
        prefill_tokens=args.prefill_tokens,
        prefill_align=args.prefill_align,
        compile_decode=args.compile_decode,
        decode_attention=args.decode_attention,
        compile_prefill=args.compile_prefill,
        decode_sdpa=args.decode_sdpa,
        prefill_sdpa=args.prefill_sdpa,
    )
    _sync(device)
    t0 = time.perf_counter()
    engine_outs = engine.generate(prompts)
    _sync(device)
    engine_s = time.perf_counter() - t0
    engine_tokens = sum(cut_at_stop(o, stops)[2] for o in engine_outs)
    st = copy.deepcopy(engine.stats)  # the timed pass only, not the profiled one
    warm = warm_pass(engine, prompts, stops, device) if args.warm_pass else None
    prof = None
    if args.profile_prompts and device.type == "cuda":
        prof = profile_engine(engine, prompts[: args.profile_prompts])

    stride = max(1, -(-len(prompts) // args.hf_prompts))
    subset = list(range(0, len(prompts), stride))
    hf = HFBatchGenerator(model, settings, stops, pad, args.hf_batch_size)
    hf.generate([prompts[0]])  # warm-up: kernels, allocator
    hf_outs, hf_s = run_hf(hf, [prompts[i] for i in subset], args.hf_batch_size, device)
    hf_tokens = sum(cut_at_stop(o, stops)[2] for o in hf_outs)
    same = sum(
        cut_at_stop(engine_outs[i], stops)[0] == cut_at_stop(o, stops)[0]
        for i, o in zip(subset, hf_outs)
    )
    del hf
    ref = load_causal_lm(args.model, args.device, "float32")
    gaps = divergence_gaps(
        ref,
        [prompts[i] for i in subset],
        [cut_at_stop(engine_outs[i], stops)[0] for i in subset],
        [cut_at_stop(o, stops)[0] for o in hf_outs],
    )
    fp32 = (
        fp32_identity(ref, prompts[: args.fp32_prompts], stops, pad, 64)
        if args.fp32_prompts
        else None
    )
    return {
        "engine_tokens_per_s": round(engine_tokens / engine_s, 1),
        "hf_batched_tokens_per_s": round(hf_tokens / hf_s, 1),
        "speedup": round((engine_tokens / engine_s) / (hf_tokens / hf_s), 2),
        "prompts": len(prompts),
        "new_tokens": args.max_new_tokens,
        "greedy_identical_share": round(same / len(subset), 4),
        "greedy_identical": same,
        "hf_prompts": len(subset),
        "hf_subset": f"prompts[::{stride}] ({len(subset)} of {len(prompts)})",
        "engine_batch_rows": args.batch_size,
        "engine_refill_rows": args.refill_rows or "default (rows/8 on GPU, 1 on CPU)",
        "hf_batch_size": args.hf_batch_size,
        "engine_tokens": engine_tokens,
        "engine_seconds": round(engine_s, 3),
        "engine_seconds_note": "includes every cache build and CUDA-graph capture",
        "engine_breakdown_s": {
            "build_and_capture": round(st.build_s, 3),
            "prefill": round(st.prefill_s, 3),
            "decode_steps": round(st.decode_s, 3),
            "host_bookkeeping": round(st.host_s, 3),
        },
        "engine_ms_per_decode_step": round(1000 * st.decode_s / max(1, st.decode_steps), 3),
        "greedy_divergences": gap_summary(gaps),
        "fp32_greedy_identity": fp32,
        "engine_warm_pass": warm,
        "engine_profile": prof,
        "hf_tokens": hf_tokens,
        "hf_seconds": round(hf_s, 3),
        "engine_decode_steps": st.decode_steps,
        "engine_prefills": st.prefills,
        "engine_shapes_rows_x_cache": st.shapes,
        "engine_graphs": engine.graphs,
        "engine_compiled_decode": args.compile_decode,
        "engine_sdpa": {"decode": args.decode_sdpa, "prefill": args.prefill_sdpa},
        "engine_decode_attention": args.decode_attention,
        "engine_compiled_prefill": args.compile_prefill,
        "engine_row_utilisation": round(st.row_steps_busy / max(1, st.row_steps), 3),
        "hardware": _hardware(device),
        "device": str(device),
        "dtype": str(model.dtype),
        "model": args.model,
        "input": args.input,
        "max_prompt_tokens": args.max_prompt_tokens,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="asset:smollm2-135m-instruct")
    p.add_argument("--input", default="asset:sharegpt", help="conversations or a prompts JSONL")
    p.add_argument("--max-prompts", type=int, default=3000)
    p.add_argument("--hf-prompts", type=int, default=384, help="size of the HF leg's subset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=256, help="engine rows")
    p.add_argument("--hf-batch-size", type=int, default=256)
    p.add_argument("--refill-rows", type=int, help="engine: refill when this many rows are free")
    p.add_argument("--prefill-tokens", type=int, help="engine: tokens per prefill forward")
    p.add_argument("--fp32-prompts", type=int, default=64, help="prompts of the fp32 check")
    p.add_argument("--prefill-align", type=int, help="engine: prefill width multiple")
    p.add_argument("--compile-decode", action="store_true", help="engine: compile the step")
    p.add_argument("--decode-attention", choices=["sdpa", "flex"], default="sdpa")
    p.add_argument("--compile-prefill", action="store_true", help="engine: compile prefills")
    p.add_argument("--decode-sdpa", help="engine: SDPA backends of the decode attention")
    p.add_argument("--prefill-sdpa", help="engine: SDPA backends of the prefill attention")
    p.add_argument(
        "--warm-pass", action="store_true", help="time a second pass on the built engine too"
    )
    p.add_argument(
        "--profile-prompts", type=int, default=256, help="CUDA: profile a pass over N prompts"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(args.out)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
