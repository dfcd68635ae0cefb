"""DFlash against DFlash2 drafters served side by side: one target, one baseline per prompt set
and temperature, every drafter on the same prompts (the target-only baseline is decoded once,
in the same process, and each drafter's speedup divides its time per token into it).

    python benchmarks/dflash2_vs_dflash.py --drafter dflash_b16=RUN_A --drafter dflash2_b16=RUN_B \
        --sets gsm8k,mt-bench,humaneval --samples 40 --temperatures 0,1 --out OUT

Per drafter, set and temperature: tau (z-lab convention: the mean over responses of each
response's mean accepted + 1) and tau_pooled (over all steps), per-slot acceptance, the
speedup over the target alone (both decoded the same way, CUDA graphs on a GPU), and at
temperature 0 the candidate walk over the first answers (--candidates K): the drafter's
walked tau, the oracle top-K tau and per-slot recall@1 / recall@K.
`--also NAME=RUN:sampling` evaluates a drafter once more with another draft sampling at
temperature > 0 (e.g. `:greedy`, a drafter's argmax drafts; by default both kinds sample);
`:auto@0.65` samples its drafts at 0.65 times the temperature (`dflash eval
--draft-temperature-scale`).
`--compile-drafter` compiles every drafter's step before its capture (`dflash eval
--compile-drafter`; --decode static or graphs); each entry's `compiled_drafter` says whether
it ran compiled (a compile that fails falls back to the uncompiled step, with a warning).

Writes OUT/dflash2_vs_dflash.json as {"<name>": {"<set>": {"t0": {...}, "t1": {...}}}} after
every measurement (a run cut short keeps what it measured; a later run into the same OUT, at
other temperatures or sets, adds to what is there) and OUT/<name>_<set>_t<T>.json
with each evaluation's full report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from dflash_trainer.eval.loading import check_compatible, load_eval_models, read_drafter
from dflash_trainer.eval.prompts import load_prompt_set, set_label
from dflash_trainer.eval.report import write_json
from dflash_trainer.eval.speculative import DRAFT_SAMPLING
from dflash_trainer.eval.static_decode import DECODE_MODES, compile_drafter_error, resolve_decode

KEEP = (
    "tau",
    "tau_pooled",
    "per_position_acceptance",
    "accepted_histogram",
    "decode_tokens_per_s",
    "num_responses",
    "lossless_mismatches",
    "candidates",
)


def _load(path: str, like: DFlashDrafter) -> DFlashDrafter:
    spec, state, _ = read_drafter(path)
    model = DFlashDrafter(spec)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    p = next(like.parameters())
    return model.to(device=p.device, dtype=p.dtype).eval()


def _speedup(base: dict[str, Any] | None, res: dict[str, Any]) -> float | None:
    if not base:
        return None
    spec_tpot = res["speculative"]["tpot_ms"]
    return base["tpot_ms"] / spec_tpot if spec_tpot else None


def _named(text: str) -> tuple[str, str]:
    """NAME=PATH, both non-empty (argparse turns the ValueError into a usage error)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH")
    return name, path


def _also(text: str) -> tuple[str, str, str, float]:
    """NAME=PATH:SAMPLING[@SCALE], SAMPLING one of speculative.DRAFT_SAMPLING, SCALE the
    draft temperature scale (default 1)."""
    name, rest = _named(text)
    path, sep, sampling = rest.rpartition(":")
    sampling, at, scale_text = sampling.partition("@")
    if not sep or not path or sampling not in DRAFT_SAMPLING:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=PATH:SAMPLING[@SCALE], SAMPLING one of "
            f"{', '.join(DRAFT_SAMPLING)}"
        )
    return name, path, sampling, num.positive(hi=10)(scale_text) if at else 1.0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--drafter", action="append", type=_named, required=True, help="NAME=PATH (repeat)"
    )
    ap.add_argument(
        "--also", action="append", type=_also, default=[], help="NAME=PATH:SAMPLING at t > 0"
    )
    ap.add_argument("--sets", default="gsm8k,mt-bench,humaneval")
    ap.add_argument("--samples", type=num.count(), default=40)
    ap.add_argument("--max-new-tokens", type=num.count(), default=256)
    ap.add_argument("--temperatures", type=num.temperatures(), default="0,1")
    ap.add_argument(
        "--candidates", type=num.integer(), default=16, help="K of the t=0 walk (0 = off)"
    )
    ap.add_argument("--candidate-responses", type=num.count(), default=10)
    ap.add_argument("--decode", choices=DECODE_MODES, default="auto")
    ap.add_argument(
        "--compile-drafter", action="store_true", help="torch.compile each drafter's step"
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True)
    return ap


def _drafters(args: argparse.Namespace) -> tuple[Any, dict[str, tuple[DFlashDrafter, str, float]]]:
    """The loaded models (the target with the first drafter) and {name: (drafter, sampling,
    draft temperature scale)}."""
    named = args.drafter
    names = [n for n, _ in named] + [a[0] for a in args.also]
    if len(set(names)) < len(names):
        raise SystemExit(f"dflash2_vs_dflash.py: error: a drafter name is given twice: {names}")
    first = load_eval_models(named[0][1], device=args.device)
    like = cast(DFlashDrafter, first.drafter)  # what load_eval_models reads: a DFlashDrafter
    drafters: dict[str, tuple[DFlashDrafter, str, float]] = {named[0][0]: (like, "auto", 1.0)}
    for name, path in named[1:]:
        drafters[name] = (_load(path, like), "auto", 1.0)
    for name, path, sampling, scale in args.also:
        drafters[name] = (_load(path, like), sampling, scale)
    for model, _, _ in drafters.values():
        check_compatible(model.spec, first.target)
    return first, drafters


def _one_set(
    args: argparse.Namespace,
    models: Any,
    drafters: dict[str, tuple[DFlashDrafter, str, float]],
    temp: float,
    set_name: str,
    summary: dict[str, Any],
) -> None:
    """Every drafter on one prompt set at one temperature; the first run has the baseline."""
    out, tkey = Path(args.out), f"t{temp:g}"
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens, temperature=temp, max_samples=args.samples)
    ps = load_prompt_set(set_name, args.samples, 0)
    label = set_label(ps.name)
    base: dict[str, Any] | None = None
    for name, (model, sampling, scale) in drafters.items():
        if temp == 0 and (sampling != "auto" or scale != 1):
            continue  # draft sampling only matters at t > 0
        t0 = time.perf_counter()
        res = evaluate_prompts(
            model,
            models.target,
            models.tokenizer,
            [p.messages for p in ps.prompts],
            dataclasses.replace(cfg, draft_temperature_scale=scale),
            baseline=base is None,
            prompt_ids=[p.id for p in ps.prompts],
            warmup=True,
            decode=args.decode,
            draft_sampling=sampling,
            candidates=args.candidates if temp == 0 else 0,
            candidate_responses=args.candidate_responses,
            compile_drafter=args.compile_drafter,
        )
        if base is None:
            base = res.get("baseline")
        entry = {k: res[k] for k in KEEP if k in res}
        entry["speedup"] = _speedup(base, res)
        entry["baseline_tpot_ms"] = base["tpot_ms"] if base else None
        entry["tpot_ms"] = res["speculative"]["tpot_ms"]
        entry["decode"], entry["draft_sampling"] = res["decode"], sampling
        entry["compiled_drafter"] = res["compiled_drafter"]
        entry["draft_temperature_scale"] = scale
        summary.setdefault(name, {}).setdefault(label, {})[tkey] = entry
        write_json(res, out / f"{name}_{label}_{tkey}.json")
        write_json(summary, out / "dflash2_vs_dflash.json")
        print(
            f"{tkey} {label:10s} {name:18s} tau {entry['tau']:.3f} speedup "
            f"{entry['speedup'] or float('nan'):.3f} ({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    models, drafters = _drafters(args)
    if args.compile_drafter and resolve_decode(args.decode, models.target) == "eager":
        error = compile_drafter_error(args.decode, models.target)  # before any measurement
        raise SystemExit(f"dflash2_vs_dflash.py: error: {error}")
    summary: dict[str, Any] = {"environment": models.identity["environment"]}
    earlier = Path(args.out) / "dflash2_vs_dflash.json"
    if earlier.exists():  # a run at other temperatures or sets into the same OUT adds to it
        try:
            before = json.loads(earlier.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(
                f"{earlier}: unreadable ({e}); move it away or give another --out"
            ) from e
        if not isinstance(before, dict):
            raise SystemExit(f"{earlier}: not a comparison summary; give another --out")
        for name, sets in before.items():
            if name != "environment" and isinstance(sets, dict):
                summary[name] = sets
    for temp in args.temperatures:
        for set_name in args.sets.split(","):
            _one_set(args, models, drafters, temp, set_name, summary)
    # The table lines above say it all; the file (strict JSON) holds the rest.
    print(f"wrote {Path(args.out) / 'dflash2_vs_dflash.json'}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    try:
        raise SystemExit(main())
    except DFlashError as e:  # a missing drafter, an unknown prompt set: the message, no trace
        raise SystemExit(f"dflash2_vs_dflash.py: error: {e}") from None
