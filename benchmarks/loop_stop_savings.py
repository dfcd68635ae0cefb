"""Completion tokens the loop stop (`dflash data regenerate --stop-loops`) would not generate.

Reads a regeneration output made without the loop stop, re-tokenizes each answer with the
target's tokenizer, and finds where `loop_tails.loop_stop` would have ended it. Over a seeded
uniform sample of the conversations it reports the answers cut, the tokens saved (of all
completion tokens) and where the cuts fall. An answer's end-of-turn token is not in its text,
so a stopped answer counts one token less here than in `completion_tokens`; the saving is
counted against `completion_tokens`.

    python benchmarks/loop_stop_savings.py --regen regen.jsonl \\
        --tokenizer asset:smollm2-135m-instruct --sample 5000 --out loop_stop_savings.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from dflash_trainer.data.loading import load_tokenizer
from dflash_trainer.data.loop_tails import STOP_EVERY, loop_stop


def savings(lines: list[str], tok: object) -> dict[str, object]:
    answers = tokens = saved = by_length = 0
    cuts: list[int] = []
    for line in lines:
        rec = json.loads(line)
        gen = rec["generation"]
        texts = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        for text, reason, n in zip(texts, gen["finish_reasons"], gen["completion_tokens"]):
            answers += 1
            tokens += n
            by_length += reason == "length"
            ids = tok(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
            cut = loop_stop(ids)
            if cut is not None:
                cuts.append(cut)
                saved += max(0, n - cut)
    q = np.percentile(cuts, [10, 50, 90]).tolist() if cuts else []
    return {
        "conversations": len(lines),
        "answers": answers,
        "answers_stopped_by_length": by_length,
        "answers_cut": len(cuts),
        "completion_tokens": tokens,
        "tokens_saved": saved,
        "share_saved": saved / tokens if tokens else 0.0,
        "cut_length_p10_p50_p90": q,
        "stop_every": STOP_EVERY,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--regen", type=Path, required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--sample", type=int, default=5000, help="conversations (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    lines = [ln for ln in args.regen.read_text(encoding="utf-8").splitlines() if ln.strip()]
    random.Random(args.seed).shuffle(lines)
    if args.sample:
        lines = lines[: args.sample]
    result = {
        "regen": str(args.regen),
        "seed": args.seed,
        **savings(lines, load_tokenizer(args.tokenizer)),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
