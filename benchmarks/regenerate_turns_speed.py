"""Turn-by-turn regeneration speed: a conversation's next turn continuing in its own cache
row (only the new user turn prefilled) against prefilling the whole conversation again.

Both legs run `dflash_trainer.data.regenerate.regenerate` on the static engine, in one
process, over the same multi-turn conversations (every user turn answered, greedy), and
differ only in `reuse_prefix`. Reported per leg: useful tokens/s (with and without the
engine's builds), prefill and decode seconds, prefills, continued turns and the history
tokens they did not prefill again; and the share of conversations whose regenerated records
are identical between the legs (in bf16 the two can part at numerical ties, as batching can).

    python benchmarks/regenerate_turns_speed.py --input prompts.jsonl --conversations 2000 \\
        --out benchmarks/results/regenerate_turns_speed_smollm2_h200.json
    python benchmarks/regenerate_turns_speed.py --device cpu --conversations 4 \\
        --max-new-tokens 8 --out /tmp/turns.json      # a tiny check that it runs
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.data.formats import read_records
from dflash_trainer.data.loading import load_causal_lm, load_tokenizer
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.regenerate import regenerate


def multi_turn(source: str, n: int) -> list[Conversation]:
    out = []
    for c in read_records(source, require_assistant=False):
        if isinstance(c, Conversation) and sum(m["role"] == "user" for m in c.messages) >= 2:
            out.append(c)
            if len(out) == n:
                break
    return out


def leg(
    args: argparse.Namespace,
    model: Any,
    tok: Any,
    convs: list[Conversation],
    reuse: bool,
    out: Path,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    report = regenerate(
        convs, model, tok, out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        max_conversation_tokens=args.max_conversation_tokens, backend="static", seed=0,
        progress=False, engine={"compile_decode": args.compile_decode, "reuse_prefix": reuse},
    )  # fmt: skip
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    e = report.engine or {}
    built = seconds - e.get("build_s", 0.0)
    return {
        "reuse_prefix": reuse,
        "tokens_per_s": round(report.new_tokens / seconds, 1),
        "tokens_per_s_without_builds": round(report.new_tokens / max(built, 1e-9), 1),
        "new_tokens": report.new_tokens,
        "assistant_turns": sum(report.finish_reasons.values()),
        "seconds": round(seconds, 3),
        "engine": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in e.items()
                   if k != "shapes"},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="asset:smollm2-135m-instruct")
    p.add_argument("--input", default="asset:sharegpt", help="conversations or a prompts JSONL")
    p.add_argument("--conversations", type=int, default=2000, help="multi-turn ones only")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-conversation-tokens", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=1024, help="engine rows")
    p.add_argument("--compile-decode", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    dtype = "bfloat16" if args.device != "cpu" else "float32"
    tok = load_tokenizer(args.model)
    model = load_causal_lm(args.model, args.device, dtype)
    convs = multi_turn(args.input, args.conversations)
    with tempfile.TemporaryDirectory() as tmp:
        legs = [leg(args, model, tok, convs, r, Path(tmp) / f"{r}.jsonl") for r in (False, True)]
        recs = [
            {json.loads(x)["id"]: json.loads(x)["messages"]
             for x in (Path(tmp) / f"{r}.jsonl").read_text().splitlines()}
            for r in (False, True)
        ]  # fmt: skip
    same = sum(recs[0][k] == recs[1].get(k) for k in recs[0])
    result = {
        "speedup": round(legs[1]["tokens_per_s"] / max(legs[0]["tokens_per_s"], 1e-9), 2),
        "conversations": len(convs),
        "identical_conversations": same,
        "legs": legs,
        "model": args.model,
        "input": args.input,
        "max_new_tokens": args.max_new_tokens,
        "hardware": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
        "dtype": dtype,
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for g in legs:
        print(f"reuse_prefix={g['reuse_prefix']!s:5}  {g['tokens_per_s']:>10,.0f} tokens/s  "
              f"prefill {g['engine'].get('prefill_s')} s  decode {g['engine'].get('decode_s')} s  "
              f"continued {g['engine'].get('continued')}")  # fmt: skip
    print(f"speedup {result['speedup']}x; identical conversations {same} of {len(recs[0])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
