"""Generation throughput: the batched regeneration path against plain per-prompt `generate`.

    python -m dflash_trainer.data.throughput --model asset:smollm2-135m-instruct \\
        --input asset:sharegpt --prompts 512 --baseline-prompts 8 --batch-size 256 \\
        --max-new-tokens 128 --device cuda

Both paths get the same first-turn prompts (the baseline a prefix of them, because at batch 1 it
is slow: ~22 tokens/s for SmolLM2 on an H200, so 8 prompts x 128 tokens take ~45 s) and the
same settings; throughput counts only useful tokens (up to and including the
stop token), not the padding a batch keeps generating after a row has stopped. Prints one JSON
object, for the dated result files in benchmarks/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

from dflash_trainer import cli_numbers as num
from dflash_trainer.data.formats import read_records
from dflash_trainer.data.hf_generate import HFBatchGenerator, per_prompt_generate
from dflash_trainer.data.loading import load_causal_lm, load_tokenizer
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.regenerate import GenerationSettings, cut_at_stop, stop_ids
from dflash_trainer.data.template import ChatTemplate


def _sync(model: Any) -> None:
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def compare_throughput(
    prompts: list[list[int]],
    model: Any,
    tokenizer: Any,
    settings: GenerationSettings,
    batch_size: int,
    baseline_prompts: int,
) -> dict[str, Any]:
    chat = ChatTemplate.probe(tokenizer)
    stops = stop_ids(tokenizer, chat, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    gen = HFBatchGenerator(model, settings, stops, pad, batch_size)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # as regenerate does
    gen.generate([prompts[order[0]]])  # warm-up: kernels, allocator
    _sync(model)
    t0 = time.perf_counter()
    batched_tokens = 0
    for i in range(0, len(order), batch_size):
        outs = gen.generate([prompts[j] for j in order[i : i + batch_size]])
        batched_tokens += sum(cut_at_stop(o, stops)[2] for o in outs)
    _sync(model)
    batched_s = time.perf_counter() - t0
    base = prompts[:baseline_prompts]
    t0 = time.perf_counter()
    outs = per_prompt_generate(model, base, settings, stops, pad)
    _sync(model)
    base_s = time.perf_counter() - t0
    base_tokens = sum(cut_at_stop(o, stops)[2] for o in outs)
    return {
        "prompts": len(prompts),
        "batch_size": batch_size,
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "batched_tokens": batched_tokens,
        "batched_seconds": round(batched_s, 3),
        "batched_tokens_per_s": round(batched_tokens / batched_s, 1),
        "per_prompt_prompts": len(base),
        "per_prompt_tokens": base_tokens,
        "per_prompt_seconds": round(base_s, 3),
        "per_prompt_tokens_per_s": round(base_tokens / base_s, 1),
        "speedup": round((batched_tokens / batched_s) / (base_tokens / base_s), 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="asset:smollm2-135m-instruct")
    p.add_argument("--input", default="asset:sharegpt")
    p.add_argument("--prompts", type=num.count(), default=512)
    p.add_argument("--baseline-prompts", type=num.count(0), default=8)
    p.add_argument("--batch-size", type=num.count(1, 1 << 16), default=256)
    p.add_argument("--max-new-tokens", type=num.count(1, 1 << 20), default=128)
    p.add_argument("--max-prompt-tokens", type=num.count(), default=2048)
    p.add_argument("--temperature", type=num.temperature(), default=0.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, args.device, args.dtype)
    chat = ChatTemplate.probe(tokenizer)
    prompts = []
    convs = read_records(args.input, require_assistant=False)
    for c in itertools.islice((c for c in convs if isinstance(c, Conversation)), 10 * args.prompts):
        first_user = next(i for i, m in enumerate(c.messages) if m["role"] == "user")
        ids = chat.prompt_ids(c.messages[: first_user + 1])
        if len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    settings = GenerationSettings(args.model, args.temperature, 1.0, args.max_new_tokens)
    result = compare_throughput(
        prompts, model, tokenizer, settings, args.batch_size, args.baseline_prompts
    )
    result |= {"model": args.model, "device": str(model.device), "dtype": str(model.dtype)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
