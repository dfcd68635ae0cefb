"""Write the first user turn of every usable ShareGPT conversation as a prompts JSONL.

The prompts file (about 10 MB) is much smaller than the ShareGPT asset (125 MB), which
helps when the GPU machine does not have the asset installed. Regeneration answers only
the first turn (`--max-turns 1`), so nothing else is needed. Prompts are deduplicated by
text and, optionally, capped in length so a batch of left-padded prompts is not dominated
by one huge paste.

    python benchmarks/sharegpt_prompts.py --out .evaldata/sharegpt_prompts_all.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_trainer.data.formats import read_records
from dflash_trainer.data.records import Conversation, ReadReport


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", default="asset:sharegpt")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-chars", type=int, default=6000, help="skip longer first turns")
    args = p.parse_args()
    report = ReadReport(source=args.input)
    seen: set[str] = set()
    kept = too_long = repeated = 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for rec in read_records(args.input, report=report, require_assistant=False):
            if not isinstance(rec, Conversation):
                continue
            first = next((m["content"] for m in rec.messages if m["role"] == "user"), None)
            if first is None:
                continue
            if len(first) > args.max_chars:
                too_long += 1
                continue
            if first in seen:
                repeated += 1
                continue
            seen.add(first)
            row = {"id": rec.id, "conversations": [{"from": "human", "value": first}]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            kept += 1
    print(
        f"{args.out}: {kept} prompts ({report.kept} conversations read, {too_long} first turns "
        f"over {args.max_chars} chars, {repeated} repeated first turns)"
    )


if __name__ == "__main__":
    main()
