"""In-batch acceptance of a trained drafter on its training documents and on held-out ones.

    python benchmarks/heldout_tau.py --drafter RUN_OR_CKPT --data PREPARED_DIR --docs 120 \
        --override data.token_budget=4096 training.max_anchors=128

Why: the training log's in-batch tau is measured on the batch being trained on. When the
served tau (`dflash eval`) is far below it, this tells the two causes apart: if held-out
documents score like the training ones, training and serving disagree (a mismatch in
masks, positions or features); if held-out documents score like served decoding, the
drafter has not generalised yet (too little data for its size). Same step code as the
trainer (run_target, prepare_blocks, drafter_loss), forward only, fp32 drafter, dense masks.
Then the same drafter through the speculative loop's own drafting path
(`DFlashBlockDrafter`), teacher-forced on held-out documents, by where the anchor sits in the
answer: it shows whether served evaluations with few new tokens can be compared with the
in-batch number, which averages over whole answers. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

import torch

from dflash_trainer.config import load_config
from dflash_trainer.data.shards import PreparedDataset
from dflash_trainer.eval.speculative import DFlashBlockDrafter
from dflash_trainer.eval.walk import accepted_run, teacher_forced, walked_tau
from dflash_trainer.formats.drafter_io import build_drafter
from dflash_trainer.target.model import FrozenTarget, load_target_model
from dflash_trainer.train.step import drafter_loss, prepare_blocks, run_target, settings_for_spec


def doc_batches(
    data: PreparedDataset, n_docs: int, budget: int
) -> Iterator[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """(documents read so far, a micro-batch of (input ids, loss mask)) over the first
    `n_docs` documents in order, each batch within `budget` tokens; a document longer than
    the budget is a batch of its own."""
    i, n = 0, min(n_docs, len(data))
    while i < n:
        docs: list[tuple[torch.Tensor, torch.Tensor]] = []
        tokens = 0
        while i < n and (not docs or tokens + len(data[i].input_ids) <= budget):
            d = data[i]
            ids = torch.from_numpy(d.input_ids.astype("int64"))
            docs.append((ids, torch.from_numpy(d.loss_mask.astype("bool"))))
            tokens += len(ids)
            i += 1
        yield i, docs


def split_metrics(
    data: PreparedDataset, n_docs: int, target: FrozenTarget, drafter: torch.nn.Module, cfg, seed
) -> dict[str, float]:
    spec = drafter.spec
    st = settings_for_spec(cfg, spec, fixed_shapes=False)
    gen = torch.Generator().manual_seed(seed)
    anchors = tau_sum = 0.0
    slot1_hits = slot1_n = 0.0
    n = min(n_docs, len(data))
    for i, docs in doc_batches(data, n_docs, cfg.data.token_budget):
        with torch.no_grad():
            tout = run_target(target, docs, st)
            blocks = prepare_blocks(tout, target, st, gen, torch.device("cpu"))
        res = drafter_loss(drafter, blocks, target.embed, target.lm_head_weight.float(), st)
        m = res.metrics
        k = float(m["anchors"])
        anchors += k
        tau_sum += float(m["exact_tau"]) * k
        print(f"{i}/{n} documents: tau {tau_sum / max(anchors, 1.0):.3f}", file=sys.stderr)
        slot1_hits += float(m["slot_acc"][0]) * float(m["slot_count"][0])
        slot1_n += float(m["slot_count"][0])
    return {
        "docs": float(n),
        "anchors": anchors,
        "exact_tau": tau_sum / max(anchors, 1.0),
        "slot1_acc": slot1_hits / max(slot1_n, 1.0),
    }


def tau_by_offset(
    data: PreparedDataset, n_docs: int, target: FrozenTarget, drafter: torch.nn.Module, stride: int
) -> dict[str, dict[str, float]]:
    """Teacher-forced acceptance+1 of anchors every `stride` tokens, by offset in the answer."""
    block = drafter.spec.block_size
    adapter = DFlashBlockDrafter(drafter, target)
    buckets: dict[str, list[int]] = {"0-63": [], "64-127": [], "128+": []}
    for j in range(min(n_docs, len(data))):
        d = data[j]
        ids = torch.from_numpy(d.input_ids.astype("int64"))
        first = int(d.loss_mask.nonzero()[0][0])
        features, greedy = teacher_forced(target, ids)
        with torch.no_grad():
            for a in range(first, len(ids) - block, stride):
                adapter.start(ids[:a], features[:a])
                run = accepted_run(adapter(ids[: a + 1], None), greedy, a, block - 1)
                off = a - first
                key = "0-63" if off < 64 else "64-127" if off < 128 else "128+"
                buckets[key].append(run + 1)
    return {k: {"anchors": len(v), "tau": sum(v) / max(len(v), 1)} for k, v in buckets.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--data", required=True, help="a `dflash data prepare` output directory")
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--override", nargs="*", default=[])
    ap.add_argument("--docs", type=int, default=232, help="documents per split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offset-docs", type=int, default=30, help="held-out documents by offset")
    ap.add_argument("--stride", type=int, default=5)
    args = ap.parse_args()
    cfg = load_config(recipe=args.recipe, overrides=args.override)
    drafter, meta = build_drafter(args.drafter)
    target = FrozenTarget(load_target_model(cfg.target), drafter.spec.target_layer_ids)
    out = {"drafter": args.drafter, "step": meta.get("step"), "recipe": args.recipe}
    for split in ("train", "eval"):
        out[split] = split_metrics(
            PreparedDataset(args.data, split), args.docs, target, drafter, cfg, args.seed
        )
    held_out = PreparedDataset(args.data, "eval")
    out["eval_by_answer_offset"] = tau_by_offset(
        held_out, args.offset_docs, target, drafter, args.stride
    )
    docs = [held_out[i] for i in range(min(args.offset_docs, len(held_out)))]
    for span in (128, None):
        out[f"eval_walk_first_{span or 'all'}"] = walked_tau(drafter, target, docs, span)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
