"""What DFlash2's modules cost per decoding step, separated from what they change in acceptance.

    python benchmarks/dflash2_step_cost.py --drafter drafters/smollm2-135m-dflash-b16 \
        --sets gsm8k,mt-bench --samples 40 --temperatures 0,1 --out OUT [--compile-drafter both]

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
differ there; the step time is comparable either way.

`--compile-drafter` (`dflash eval --compile-drafter`: the drafter step torch.compile'd before
its capture; needs --decode static or graphs, which auto picks on a GPU) measures the drafters
compiled. `--compile-drafter both` measures each drafter uncompiled and then compiled, in the
same process against the same baseline: rows `NAME` and `NAME_compiled`.

Writes OUT/dflash2_step_cost.json: {"environment", "compile_drafter": off|on|both, "runs":
{set: {"t<T>": {row: {...}}}}}, each row with tau, tau_pooled, tpot_ms, step_ms, decode,
compiled (whether its drafter step ran compiled: a compile that fails falls back, with a
warning), baseline_tpot_ms (the first row only), speedup, and extra_step_ms: step_ms over
the `dflash` row compiled alike (so `dflash2_compiled` is compared with `dflash_compiled`).
Compiled rows of `both` also have compile_saves_ms: the uncompiled row's step_ms minus theirs.
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
from dflash_trainer.eval.static_decode import compile_drafter_error, resolve_decode
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
    models: Any,
    model: DFlashDrafter,
    cfg: EvalConfig,
    ps: Any,
    baseline: bool,
    decode: str,
    compiled: bool,
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
        compile_drafter=compiled,
    )
    tpot = res["speculative"]["tpot_ms"]
    return {
        "tau": res["tau"],
        "tau_pooled": res["tau_pooled"],
        "tpot_ms": tpot,
        "step_ms": tpot * res["tau_pooled"],
        "decode": res["decode"],
        "compiled": res["compiled_drafter"],
        "baseline_tpot_ms": res["baseline"]["tpot_ms"] if baseline else None,
    }


def _variants(
    twins: dict[str, DFlashDrafter], compile_drafter: str
) -> list[tuple[str, DFlashDrafter, bool]]:
    """(row name, drafter, compiled) in measuring order: with `both`, each drafter's compiled
    row right after its uncompiled one."""
    out: list[tuple[str, DFlashDrafter, bool]] = []
    for name, model in twins.items():
        if compile_drafter != "on":
            out.append((name, model, False))
        if compile_drafter != "off":
            out.append((f"{name}_compiled" if compile_drafter == "both" else name, model, True))
    return out


def _row_line(temp: float, label: str, name: str, row: dict[str, Any], seconds: float) -> str:
    extra = f"+{row['extra_step_ms']:.3f}"
    if "compile_saves_ms" in row:
        extra += f", compile saves {row['compile_saves_ms']:.3f}"
    return (
        f"t{temp:g} {label:10s} {name:31s} tau {row['tau']:.3f} step {row['step_ms']:.3f} ms "
        f"({extra}) speedup {row['speedup']:.3f} ({seconds:.0f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="a DFlash drafter (run dir or export)")
    ap.add_argument("--sets", default="gsm8k,mt-bench")
    ap.add_argument("--samples", type=num.count(), default=40)
    ap.add_argument("--max-new-tokens", type=num.count(), default=256)
    ap.add_argument("--temperatures", type=num.temperatures(), default="0,1")
    ap.add_argument("--device", default=None)
    ap.add_argument("--decode", default="auto", help="auto: CUDA graphs on a GPU, else eager")
    ap.add_argument(
        "--compile-drafter",
        nargs="?",
        const="on",
        default="off",
        choices=("off", "on", "both"),
        help="compile the drafter step (on: every row; both: every drafter uncompiled and "
        "compiled, rows NAME and NAME_compiled)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Every drafter and temperature on the same prompts: each set read once, before the models.
    sets = [load_prompt_set(name, args.samples, 0) for name in args.sets.split(",")]
    models, twins = _twins(args.drafter, args.device)
    if args.compile_drafter != "off" and resolve_decode(args.decode, models.target) == "eager":
        raise compile_drafter_error(args.decode, models.target)  # before any measurement
    summary: dict[str, Any] = {
        "environment": models.identity["environment"],
        "compile_drafter": args.compile_drafter,
        "runs": {},
    }
    for temp in args.temperatures:
        cfg = EvalConfig(
            max_new_tokens=args.max_new_tokens, temperature=temp, max_samples=args.samples
        )
        for ps in sets:
            rows: dict[str, Any] = {}
            for name, model, compiled in _variants(twins, args.compile_drafter):
                t0 = time.perf_counter()
                row = _one(models, model, cfg, ps, not rows, args.decode, compiled)
                first = next(iter(rows.values()), row)  # holds the baseline
                # Like with like: DFlash compiled the same way, and the uncompiled twin.
                base = rows.get("dflash_compiled" if name.endswith("_compiled") else "dflash", row)
                row["extra_step_ms"] = row["step_ms"] - base["step_ms"]
                row["speedup"] = first["baseline_tpot_ms"] / row["tpot_ms"]
                if name.endswith("_compiled"):
                    row["compile_saves_ms"] = (
                        rows[name.removesuffix("_compiled")]["step_ms"] - row["step_ms"]
                    )
                rows[name] = row
                print(
                    _row_line(temp, set_label(ps.name), name, row, time.perf_counter() - t0),
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
