"""Regeneration throughput: batched left-padded HF generate vs plain per-prompt generate.

Same model, same prompts (the first user turn of ShareGPT conversations), same settings,
measured in one process. Generated tokens are counted up to the first stop id.

    python benchmarks/regenerate_throughput.py --n 64 --batch 64 --max-new-tokens 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_trainer.data.formats import read_records
from dflash_trainer.data.hf_generate import HFBatchGenerator, per_prompt_generate
from dflash_trainer.data.loading import load_causal_lm, load_tokenizer
from dflash_trainer.data.regenerate import GenerationSettings, cut_at_stop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="asset:smollm2-135m-instruct")
    ap.add_argument("--input", default="asset:sharegpt")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    tok = load_tokenizer(args.model)
    model = load_causal_lm(args.model, device="cuda", dtype="bfloat16")
    prompts = []
    for rec in read_records(args.input, require_assistant=False):
        first_user = next((m for m in rec.messages if m["role"] == "user"), None)
        if first_user is None:
            continue
        ids = tok.apply_chat_template([first_user], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if len(ids) <= 512:
            prompts.append(list(ids))
        if len(prompts) >= args.n:
            break
    settings = GenerationSettings(model=args.model, max_new_tokens=args.max_new_tokens)
    stops = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} - {None})
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]

    def count(outs: list[list[int]]) -> int:
        return sum(len(cut_at_stop(o, stops)[0]) for o in outs)

    gen = HFBatchGenerator(model, settings, stops, pad, args.batch)
    gen.generate(prompts[:2])  # warm-up
    results = {}
    for name, fn in (
        (
            "batched",
            lambda ps: [
                o
                for s in range(0, len(ps), args.batch)
                for o in gen.generate(ps[s : s + args.batch])
            ],
        ),
        ("per_prompt", lambda ps: per_prompt_generate(model, ps, settings, stops, pad)),
    ):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = fn(prompts)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        results[name] = {"seconds": dt, "tokens": count(outs), "tokens_per_s": count(outs) / dt}
    results["speedup"] = results["batched"]["tokens_per_s"] / results["per_prompt"]["tokens_per_s"]
    info = {
        "device": torch.cuda.get_device_name(),
        "n": len(prompts),
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        **results,
    }
    print(json.dumps(info, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
