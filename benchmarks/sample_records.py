"""Nested random subsets of a JSONL file, for a scaling curve.

A regenerated set is written source by source (all of one chat source, then the next), so its
first N records are not a fair sample of it. This shuffles the records once with a fixed seed
and writes the first N of that order for each size: every smaller subset is inside every larger
one, and each is a uniform sample of the whole. `samples.json` records, per subset and for the
whole file, the records and the assistant turns they hold (a `dflash data regenerate` record
counts one turn per entry of `generation.finish_reasons`; other records count their assistant
messages).

    python benchmarks/sample_records.py --input regen.jsonl --sizes 4000 12000 --out OUT
    # OUT/sample_4000.jsonl, OUT/sample_12000.jsonl, OUT/samples.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def assistant_turns(line: str) -> int:
    rec = json.loads(line)
    gen = rec.get("generation") or {}
    if "finish_reasons" in gen:
        return len(gen["finish_reasons"])
    msgs = rec.get("messages") or rec.get("conversations") or []
    return sum(1 for m in msgs if m.get("role", m.get("from")) in ("assistant", "gpt"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", type=Path, required=True)
    p.add_argument("--sizes", type=int, nargs="+", required=True, help="records per subset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="folder for the subsets")
    args = p.parse_args(argv)
    lines = [ln for ln in args.input.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if max(args.sizes) > len(lines):
        p.error(f"--sizes {max(args.sizes)} is more than the {len(lines)} records of {args.input}")
    random.Random(args.seed).shuffle(lines)
    turns = [assistant_turns(ln) for ln in lines]
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"input": str(args.input), "seed": args.seed}
    summary["all"] = {"records": len(lines), "assistant_turns": sum(turns)}
    for n in sorted(args.sizes):
        path = args.out / f"sample_{n}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("\n".join(lines[:n]) + "\n", encoding="utf-8")
        tmp.replace(path)
        summary[str(n)] = {"records": n, "assistant_turns": sum(turns[:n]), "file": str(path)}
        print(f"{path}: {n} records, {sum(turns[:n])} assistant turns")
    (args.out / "samples.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
