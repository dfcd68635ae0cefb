"""The whole online step (target forward + drafter step + optimizer) through the real Trainer.

The target is built from its config with random weights (FLOPs and memory are those of
the real model; acceptance is meaningless), the data are random prepared shards whose
documents fill the token budget. Reports time to the first finished step (compile
included), steady step time split target / drafter, samples/s, tokens/s and peak
memory, next to the planner's prediction when the planner is importable.

    python benchmarks/online_step.py --recipe qwen3.6-27b --docs 4 --steps 6 --json out.json

--target-precision both measures the bf16 target and then the FP8 one
(`target.precision=fp8`) in the same process, same data and steps: the first Trainer is
released (and the compile caches reset) before the second is built, and each leg's peak
memory is counted from its own start (`start_gb` says what was still allocated then).
--fp8-json merges the two legs into the FP8 results file as
`{"bf16": {"target_ms", "drafter_ms", "step_ms", "peak_gb", ...}, "fp8": {...}}`. A leg
that runs out of memory (the bf16 27B target with its drafter needs about 100 GB, more than
an H100 has) is recorded with its error and the next leg still runs.
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

from dflash_trainer.config import ConfigError, load_config, replace
from dflash_trainer.data.shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST, ShardWriter
from dflash_trainer.errors import DFlashError
from dflash_trainer.target.configs import load_target_config
from dflash_trainer.train.trainer import Trainer


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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _hardware() -> str:
    """The planner preset of this GPU (h200 when it is not one of the presets)."""
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    return next((key for key in ("h100", "b200") if key in name), "h200")


def _plan(cfg: Any) -> Any:
    from dflash_trainer.plan import planner

    try:
        return planner.predict(cfg, _hardware())
    except Exception as e:  # the comparison is optional; the measurement is not
        print(f"planner prediction unavailable: {e!r}", file=sys.stderr)
        return None


def main() -> None:
    args = parse_args()
    legs = ["bf16", "fp8"] if args.target_precision == "both" else [args.target_precision]
    results: dict[str, Any] = {}
    for i, precision in enumerate(legs):
        if i:
            _release()
        try:
            results[precision] = measure(args, precision, json_path(args, precision, len(legs)))
        except torch.cuda.OutOfMemoryError as e:
            print(f"{precision} leg: out of GPU memory: {e}", file=sys.stderr)
            results[precision] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
        except (ConfigError, DFlashError) as e:  # e.g. an FP8 target on a GPU without FP8
            print(f"{precision} leg: {e}", file=sys.stderr)
            results[precision] = {"error": str(e)}
    if args.fp8_json:
        from fp8_target_check import merge_json, results_path

        merge_json(Path(args.fp8_json), fp8_summary(args, results))
        print(f"wrote {results_path(args.fp8_json)}")
    if all("error" in r for r in results.values()):
        sys.exit(1)


def json_path(args: argparse.Namespace, precision: str, legs: int) -> str | None:
    """--json for one leg; with two legs, OUT.json becomes OUT.bf16.json and OUT.fp8.json."""
    if not args.json or legs == 1:
        return args.json
    p = Path(args.json)
    return str(p.with_name(f"{p.stem}.{precision}{p.suffix}"))


def _release() -> None:
    """Free the previous leg: its Trainer is gone; drop compiled graphs and cached blocks."""
    import gc

    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def fp8_summary(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """The FP8 results file's keys for these legs (ms and GB, as the issue's goals are stated)."""
    out: dict[str, Any] = {
        "online_step": {
            "recipe": args.recipe,
            "docs": args.docs,
            "steps": args.steps,
            "overrides": args.override,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
        }
    }
    for precision, r in results.items():
        if "error" in r:
            out[precision] = {"error": r["error"]}
            continue
        out[precision] = {
            "target_ms": 1e3 * r["target_s_median"],
            "drafter_ms": 1e3 * r["drafter_s_median"],
            "step_ms": 1e3 * r["step_s_median"],
            "peak_gb": r["peak_gb"],
            "start_gb": r["start_gb"],
            "first_step_s": r["first_step_s"],
        }
        pvm = r.get("predicted_vs_measured")
        if pvm:  # the planner's column for this precision, same units
            out[precision]["predicted"] = {
                "target_ms": 1e3 * pvm["target_side_s"][0],
                "drafter_ms": 1e3 * pvm["drafter_s"][0],
                "step_ms": 1e3 * pvm["step_s"][0],
                "peak_gb": pvm["peak_gb"][0],
            }
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="qwen3.6-27b")
    ap.add_argument(
        "--docs", type=int, default=4, help="documents per step (budget / docs tokens each)"
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--override", nargs="*", default=[])
    ap.add_argument("--json")
    ap.add_argument(
        "--profile", action="store_true", help="print the top ops (host and GPU) of two steps"
    )
    ap.add_argument(
        "--target-precision",
        choices=["bf16", "fp8", "both"],
        default="bf16",
        help="both: the bf16 leg, then the FP8 target's, in this process",
    )
    ap.add_argument("--fp8-json", help="merge the legs into this FP8 results file")
    return ap.parse_args()


def measure(args: argparse.Namespace, precision: str, json_out: str | None) -> dict[str, Any]:
    """One leg: a Trainer with this target precision, its first step and `steps` more."""
    base = load_config(recipe=args.recipe, overrides=args.override)
    budget = base.data.token_budget
    doc_len = budget // args.docs
    tmp = Path(tempfile.mkdtemp(prefix="dflash-online-"))
    # The target's own vocabulary (a bundled config for hub ids: no download).
    vocab = load_target_config(replace(base, target={"random_init": True}).target).vocab_size
    data = random_prepared(
        tmp / "data",
        vocab,
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
        f"target.precision={precision}",
    ]
    cfg = load_config(recipe=args.recipe, overrides=overrides)
    start_gb = torch.cuda.memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0
    t0 = time.perf_counter()
    tr = Trainer(cfg, log_to_console=True)
    t_built = time.perf_counter() - t0
    first = tr.train_step()
    _sync()
    t_first = time.perf_counter() - t0
    stats, wall = [], []
    for _ in range(args.steps):
        t1 = time.perf_counter()
        stats.append(tr.train_step())
        _sync()
        wall.append(time.perf_counter() - t1)
    # Wall time per optimizer step (what the planner predicts): target + drafter stages
    # plus clipping, the optimizer and the scheduler.
    med = statistics.median(wall)
    plan = _plan(cfg)
    out = {
        "recipe": args.recipe,
        "target_precision": precision,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "build_s": t_built,
        "first_step_s": t_first,
        "first_step_loss": first.loss,
        "step_s_median": med,
        "step_s_all": wall,
        "target_s_median": statistics.median(s.target_s for s in stats),
        "drafter_s_median": statistics.median(s.drafter_s for s in stats),
        "samples_per_s": args.docs / med,
        "tokens_per_s": stats[-1].tokens / med,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 - start_gb
        if torch.cuda.is_available()
        else 0.0,
        "start_gb": start_gb,
        "losses": [s.loss for s in stats],
        "prediction": plan.to_dict() if plan is not None else None,
    }
    print(json.dumps(out, indent=2, default=str))
    print(
        f"\n{args.recipe} ({precision} target): step {med * 1e3:.0f} ms (target {out['target_s_median'] * 1e3:.0f} + "
        f"drafter {out['drafter_s_median'] * 1e3:.0f}), {out['samples_per_s']:.1f} samples/s, "
        f"{out['tokens_per_s']:.0f} tok/s, peak {out['peak_gb']:.1f} GB, first step after {t_first:.0f} s"
    )
    if plan is not None:
        pt = plan.times
        pred = {
            "step_s": plan.step_s,
            "target_side_s": pt.target_side,
            "drafter_s": pt.drafter,
            "peak_gb": plan.memory[0].peak_gb,
        }
        meas = {
            "step_s": med,
            "target_side_s": out["target_s_median"],
            "drafter_s": out["drafter_s_median"],
            "peak_gb": out["peak_gb"],
        }
        out["predicted_vs_measured"] = {k: (pred[k], meas[k]) for k in pred}
        print(
            "predicted vs measured: "
            + ", ".join(
                f"{k} {pred[k]:.4g}/{meas[k]:.4g} ({(pred[k] / meas[k] - 1) * 100:+.0f}%)"
                for k in pred
                if meas[k]
            )
        )
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=2, default=str))
    if args.profile:
        profile_steps(tr)
    return out


def profile_steps(tr: Trainer, steps: int = 2) -> None:
    """Where a step's time goes: top ops by host time and by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tr.train_step()
        _sync()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
    print(f"kernel launches per step: {launches / steps:.0f}")


if __name__ == "__main__":
    main()
