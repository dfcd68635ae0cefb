"""Expected acceptance at temperature 1 of a DFlash drafter's drafts sampled at other draft
temperatures, teacher-forced on held-out documents.

    python benchmarks/draft_temperature_t1.py --drafter DRAFTER --data PREPARED_DIR \
        --docs 200 --temperatures 0.6,0.8,1,1.2,1.4

At t > 0 a step's drafts are accepted slot by slot with probability sum_x min(p(x), q(x))
when the draft x was drawn from q and the target samples from p (rejection sampling keeps the
output distributed as p for any q). The drafter serves q = softmax(z / T); a lower or higher
draft temperature changes q and nothing else, so it is a lossless knob if it raises that
overlap. This measures it without generating: the drafter's blocks at sampled anchors of
held-out documents (the trainer's step code, fp32, dense masks), the target's distribution
p at T = 1 at each slot's position, and the expected tau 1 + sum_k prod_{j <= k} alpha_j per
block (alpha_j the slot's overlap), averaged over blocks. Greedy drafts (q one-hot on the
argmax) are reported beside it, and so is t=0 (a slot accepted when the drafter's argmax is
the target's), so that one run also says what a change costs greedy decoding. The context is
teacher-forced along the document's tokens (the target's greedy answers for regenerated
data), not along sampled text: the absolute values sit above served t=1 tau, and the
ranking of draft temperatures can differ from the served one (for the published SmolLM2
drafter it did: 0.65 T ahead here, not when served,
benchmarks/draft_temperature_t1_smollm2_cpu_202612.md). A screen, not a verdict.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heldout_tau import doc_batches

from dflash_trainer import cli_numbers as num
from dflash_trainer.config import load_config
from dflash_trainer.core.anchors import block_position_ids
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.data.shards import PreparedDataset
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.loading import load_eval_models
from dflash_trainer.target.model import FrozenTarget
from dflash_trainer.train.step import build_masks, prepare_blocks, run_target, settings_for_spec


def expected_tau(
    alpha_NB: torch.Tensor, valid_NB: torch.Tensor, real_N: torch.Tensor
) -> torch.Tensor:
    """1 + sum_k prod_{j <= k} alpha_j over slots 1..B-1 of each real block [n_real]."""
    a = torch.where(valid_NB, alpha_NB, torch.zeros_like(alpha_NB))[:, 1:]
    return (1 + torch.cumprod(a, -1).sum(-1))[real_N]


def block_overlaps(
    drafter: DFlashDrafter, target: FrozenTarget, docs: list, st, gen, temps: list[float]
) -> tuple[torch.Tensor, dict[float, torch.Tensor], torch.Tensor]:
    """(greedy-draft expected tau at t=1, {T: sampled-draft expected tau at t=1}, tau at t=0)
    of one micro-batch's blocks. At t=0 a slot is accepted when the drafter's argmax is the
    target's (along the document's tokens: the target's own greedy answers for regenerated
    data, so this is the served t=0 walk without its bf16 rounding)."""
    tout = run_target(target, docs, st)
    blocks = prepare_blocks(tout, target, st, gen, torch.device("cpu"))
    an = blocks.anchors
    emb = target.embed(blocks.block_ids_NB.reshape(-1)).float()
    pos = block_position_ids(an).reshape(-1)
    masks = build_masks(blocks, drafter.spec, False)
    feats = blocks.features_TF.float()
    hidden = drafter(feats, blocks.pack.position_ids_T, emb, pos, masks)
    hidden = hidden.view(an.num_anchors, an.block_size, -1)
    valid = an.slot_valid_NB.clone()
    valid[:, 0] = False  # slot 0 is the anchor itself
    w = target.lm_head_weight.float()
    assert blocks.target_hidden_NBH is not None
    p = torch.softmax(blocks.target_hidden_NBH.float() @ w.t(), -1)
    z = hidden @ w.t()
    greedy = expected_tau(p.gather(-1, z.argmax(-1, keepdim=True)).squeeze(-1), valid, an.real_N)
    sampled = {
        t: expected_tau(torch.minimum(p, torch.softmax(z / t, -1)).sum(-1), valid, an.real_N)
        for t in temps
    }
    same = (z.argmax(-1) == p.argmax(-1)).float()
    return greedy, sampled, expected_tau(same, valid, an.real_N)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--drafter", required=True, help="a run, checkpoint or exported drafter")
    ap.add_argument("--data", required=True, help="a `dflash data prepare` output directory")
    ap.add_argument("--split", default="eval", choices=("eval", "train"))
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--docs", type=num.count(), default=200)
    ap.add_argument("--temperatures", type=num.temperatures(), default="0.6,0.8,1,1.2,1.4")
    ap.add_argument("--seed", type=num.seed(), default=0)
    args = ap.parse_args()
    temps = [t for t in args.temperatures if t > 0]
    # lk: the step keeps the target's final hidden states at every slot (its distribution).
    cfg = load_config(
        recipe=args.recipe,
        overrides=[
            "training.loss=lk",
            "training.weighting=decay",
            "data.token_budget=4096",
            "training.max_anchors=128",
        ],
    )
    data = PreparedDataset(args.data, args.split)  # before the models: a bad path fails fast
    models = load_eval_models(args.drafter, dtype="float32", device="cpu")
    drafter, target = models.drafter, models.target
    spec = drafter.spec
    st = settings_for_spec(cfg, spec, fixed_shapes=False)
    gen = torch.Generator().manual_seed(args.seed)
    greedy: list[torch.Tensor] = []
    t0: list[torch.Tensor] = []
    sampled: dict[float, list[torch.Tensor]] = {t: [] for t in temps}
    n = min(args.docs, len(data))
    for i, docs in doc_batches(data, args.docs, cfg.data.token_budget):
        with torch.no_grad():
            g, s, g0 = block_overlaps(drafter, target, docs, st, gen, temps)
        greedy.append(g)
        t0.append(g0)
        for t in temps:
            sampled[t].append(s[t])
        print(f"{i}/{n} documents", file=sys.stderr, flush=True)
    blocks = torch.cat(greedy)
    by_t = {t: torch.cat(v) for t, v in sampled.items()}

    def stats(x: torch.Tensor) -> dict[str, float]:
        return {"mean": float(x.mean()), "stderr": float(x.std() / x.numel() ** 0.5)}

    out: dict[str, object] = {
        "drafter": args.drafter,
        "split": args.split,
        "docs": n,
        "blocks": int(blocks.numel()),
        "block_size": spec.block_size,
        "expected_tau_t0": stats(torch.cat(t0)),
        "expected_tau_t1": {
            "greedy_drafts": stats(blocks),
            **{f"sampled_T{t:g}": stats(x) for t, x in by_t.items()},
        },
    }
    if 1.0 in by_t:  # paired over the same blocks: the spread of a difference is smaller
        out["minus_sampled_T1"] = {
            "greedy_drafts": stats(blocks - by_t[1.0]),
            **{f"sampled_T{t:g}": stats(x - by_t[1.0]) for t, x in by_t.items() if t != 1.0},
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    try:
        main()
    except DFlashError as e:  # a missing drafter or data directory: the message, no trace
        raise SystemExit(f"draft_temperature_t1.py: error: {e}") from None
