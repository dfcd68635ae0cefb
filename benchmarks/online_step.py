"""The whole online step (target forward + drafter step + optimizer) through the real Trainer.

The target is built from its config with random weights (FLOPs and memory are those of
the real model; acceptance is meaningless), the data are random prepared shards whose
documents fill the token budget. Reports time to the first finished step (compile
included), steady step time split target / drafter, samples/s, tokens/s and peak
memory, next to the planner's prediction when the planner is importable.

    python benchmarks/online_step.py --recipe qwen3.6-27b --docs 4 --steps 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_trainer.config import load_config
from dflash_trainer.data.shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST, ShardWriter
from dflash_trainer.trainer import Trainer


def random_prepared(path: Path, vocab: int, mask_id: int, doc_len: int, n_docs: int) -> Path:
    rng = np.random.default_rng(0)
    w = ShardWriter(path, "train")
    for i in range(n_docs):
        ids = rng.integers(0, vocab, doc_len).astype(np.int32)
        ids[ids == mask_id] = 0
        mask = np.ones(doc_len, dtype=bool)
        mask[: doc_len // 8] = False
        w.add(f"d{i}", ids, mask)
    entries = w.close()
    split = {
        "documents": n_docs,
        "tokens": n_docs * doc_len,
        "supervised_tokens": 0,
        "shards": entries,
    }
    (path / MANIFEST).write_text(
        json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "splits": {"train": split}})
    )
    return path


def predicted(cfg: Any) -> dict[str, Any] | None:
    try:
        from dflash_trainer import planner

        fn = getattr(planner, "predict", None)
        if fn is None:
            return None
        out = fn(cfg, "h200")
        return out if isinstance(out, dict) else getattr(out, "__dict__", {"value": str(out)})
    except Exception as e:  # the comparison is optional; the measurement is not
        print(f"planner prediction unavailable: {e!r}", file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="qwen3.6-27b")
    ap.add_argument(
        "--docs", type=int, default=4, help="documents per step (budget / docs tokens each)"
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--override", nargs="*", default=[])
    ap.add_argument("--json")
    args = ap.parse_args()
    base = load_config(recipe=args.recipe)
    budget = base.data.token_budget
    doc_len = budget // args.docs
    tmp = Path(tempfile.mkdtemp(prefix="dflash-online-"))
    data = random_prepared(
        tmp / "data",
        248320 if "qwen3.6" in args.recipe else 151936,
        base.drafter.mask_token_id or 0,
        doc_len,
        args.docs * (args.steps + 4),
    )
    overrides = [
        "target.random_init=true",
        f"data.train={data}",
        f"data.max_doc_tokens={doc_len}",
        "distributed.placement=colocated",
        f"run.output_dir={tmp / 'run'}",
        "training.loss_chunk_rows=1024",
        *args.override,
    ]
    cfg = load_config(recipe=args.recipe, overrides=overrides)
    t0 = time.perf_counter()
    tr = Trainer(cfg, log_to_console=True)
    t_built = time.perf_counter() - t0
    first = tr.train_step()
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    stats = [tr.train_step() for _ in range(args.steps)]
    step_s = [s.target_s + s.drafter_s for s in stats]
    med = statistics.median(step_s)
    out = {
        "recipe": args.recipe,
        "device": torch.cuda.get_device_name(),
        "build_s": t_built,
        "first_step_s": t_first,
        "first_step_loss": first.loss,
        "step_s_median": med,
        "target_s_median": statistics.median(s.target_s for s in stats),
        "drafter_s_median": statistics.median(s.drafter_s for s in stats),
        "samples_per_s": args.docs / med,
        "tokens_per_s": stats[-1].tokens / med,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
        "losses": [s.loss for s in stats],
        "prediction": predicted(cfg),
    }
    print(json.dumps(out, indent=2, default=str))
    print(
        f"\n{args.recipe}: step {med * 1e3:.0f} ms (target {out['target_s_median'] * 1e3:.0f} + "
        f"drafter {out['drafter_s_median'] * 1e3:.0f}), {out['samples_per_s']:.1f} samples/s, "
        f"{out['tokens_per_s']:.0f} tok/s, peak {out['peak_gb']:.1f} GB, first step after {t_first:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
