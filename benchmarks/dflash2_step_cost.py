"""What DFlash2's modules cost per decoding step, separated from what they change in acceptance.

    python benchmarks/dflash2_step_cost.py --drafter drafters/smollm2-135m-dflash-b16 \
        --sets gsm8k,mt-bench --samples 40 --temperatures 0,1 --out OUT

A DFlash2 drafter built on a trained DFlash drafter with its convolutions and selector at
their no-op initialisation drafts the same tokens at t=0 (the walk is the argmax), so any
difference in time per step is the modules' cost. Three drafters share one target and one
target-only CUDA-graph baseline per set and temperature:

- `dflash`: the drafter as given;
- `dflash2`: its DFlash2 twin (convolutions around every sublayer, the selector's top-K walk);
- `dflash2_selector_only`: the twin with its convolutions removed, so the two costs separate.

Per drafter, set and temperature: tau (z-lab convention), pooled tau, time per output token
and per speculative step (time per token x pooled tau), the speedup over the target alone.
At t > 0 each drafter samples its drafts (DFlash2 over its K candidates), so acceptance may
differ there; the step time is comparable either way. Writes OUT/dflash2_step_cost.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch

from dflash_trainer import cli_numbers as num
from dflash_trainer.config import EvalConfig
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.evaluate import evaluate_prompts
from dflash_trainer.eval.loading import load_eval_models
from dflash_trainer.eval.prompts import load_prompt_set, set_label
from dflash_trainer.eval.report import write_json
from dflash_trainer.train.drafter_init import init_drafter_from


def _twins(path: str, device: str | None) -> tuple[Any, dict[str, DFlashDrafter]]:
    """The loaded target and drafter, and the drafter's DFlash2 twins (same device, dtype)."""
    models = load_eval_models(path, device=device)
    base = cast(DFlashDrafter, models.drafter)  # what load_eval_models reads: a DFlashDrafter
    if base.spec.is_dflash2:
        raise SystemExit(f"{path}: give a DFlash drafter (this one is DFlash2)")
    spec2 = dataclasses.replace(base.spec, kind="dflash2")
    p = next(base.parameters())
    twins: dict[str, DFlashDrafter] = {"dflash": base}
    for name in ("dflash2", "dflash2_selector_only"):
        model = DFlashDrafter(spec2)
        init_drafter_from(model, spec2, path, lambda _msg: None)
        if name == "dflash2_selector_only":
            for layer in model.layers:  # a measurement variant: no convolution runs at all
                layer.attention_conv = layer.mlp_conv = None  # type: ignore[assignment]
        twins[name] = model.to(device=p.device, dtype=p.dtype).eval()
    return models, twins


def _one(
    models: Any, model: DFlashDrafter, cfg: EvalConfig, ps: Any, baseline: bool, decode: str
) -> dict[str, Any]:
    res = evaluate_prompts(
        model,
        models.target,
        models.tokenizer,
        [q.messages for q in ps.prompts],
        cfg,
        baseline=baseline,
        prompt_ids=[q.id for q in ps.prompts],
        warmup=True,
        decode=decode,
    )
    tpot = res["speculative"]["tpot_ms"]
    return {
        "tau": res["tau"],
        "tau_pooled": res["tau_pooled"],
        "tpot_ms": tpot,
        "step_ms": tpot * res["tau_pooled"],
        "decode": res["decode"],
        "baseline_tpot_ms": res["baseline"]["tpot_ms"] if baseline else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="a DFlash drafter (run dir or export)")
    ap.add_argument("--sets", default="gsm8k,mt-bench")
    ap.add_argument("--samples", type=num.count(), default=40)
    ap.add_argument("--max-new-tokens", type=num.count(), default=256)
    ap.add_argument("--temperatures", type=num.temperatures(), default="0,1")
    ap.add_argument("--device", default=None)
    ap.add_argument("--decode", default="auto", help="auto: CUDA graphs on a GPU, else eager")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Every drafter and temperature on the same prompts: each set read once, before the models.
    sets = [load_prompt_set(name, args.samples, 0) for name in args.sets.split(",")]
    models, twins = _twins(args.drafter, args.device)
    summary: dict[str, Any] = {"environment": models.identity["environment"], "runs": {}}
    for temp in args.temperatures:
        cfg = EvalConfig(
            max_new_tokens=args.max_new_tokens, temperature=temp, max_samples=args.samples
        )
        for ps in sets:
            rows: dict[str, Any] = {}
            for name, model in twins.items():
                t0 = time.perf_counter()
                rows[name] = _one(models, model, cfg, ps, not rows, args.decode)
                base = rows["dflash"]
                rows[name]["extra_step_ms"] = rows[name]["step_ms"] - base["step_ms"]
                rows[name]["speedup"] = base["baseline_tpot_ms"] / rows[name]["tpot_ms"]
                print(
                    f"t{temp:g} {set_label(ps.name):10s} {name:22s} tau {rows[name]['tau']:.3f} step "
                    f"{rows[name]['step_ms']:.3f} ms (+{rows[name]['extra_step_ms']:.3f}) "
                    f"speedup {rows[name]['speedup']:.3f} ({time.perf_counter() - t0:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            summary["runs"].setdefault(set_label(ps.name), {})[f"t{temp:g}"] = rows
            write_json(summary, out / "dflash2_step_cost.json")
    print(f"wrote {out / 'dflash2_step_cost.json'}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    try:
        raise SystemExit(main())
    except DFlashError as e:  # a missing drafter, an unknown prompt set: the message, no trace
        raise SystemExit(f"dflash2_step_cost.py: error: {e}") from None
