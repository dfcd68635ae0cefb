"""`dflash plan`'s command line and readable table (the model is in planner.py).

The table puts the BF16 and FP8 targets side by side: per-GPU memory with headroom
(and the compile-off figure), the step split into target / transfer / drafter /
optimizer, throughput, hours per epoch, days for the run and the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from dflash_trainer import cli_numbers as num
from dflash_trainer import config_cli
from dflash_trainer.config import Config
from dflash_trainer.plan.dataset import check_plan_data, data_stats
from dflash_trainer.plan.hardware import Hardware, get_hardware, hardware_names
from dflash_trainer.plan.planner import Prediction, calibrate, predict


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """--config / --recipe / overrides / --trust-remote-code, as every config command."""
    config_cli.add_config_arguments(p)


def add_hardware_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default="h200", choices=hardware_names())
    p.add_argument(
        "--gpus", type=num.count(1, 65536), default=None, help="GPUs in the run (default: 1 rank)"
    )
    p.add_argument("--placement", choices=["colocated", "pairs"], default=None)
    for flag, what, kind in (
        ("--memory-gb", "memory per GPU", num.positive(1e6)),
        ("--bf16-tflops", "dense bf16 peak", num.positive(1e6)),
        ("--fp8-tflops", "dense FP8 peak", num.positive(1e6)),
        ("--bandwidth-gbs", "memory bandwidth", num.positive(1e6)),
        ("--link-gbs", "GPU-to-GPU bandwidth per direction", num.positive(1e6)),
        ("--efficiency", "achieved / peak matmul rate", num.fraction(open_low=True)),
    ):
        p.add_argument(flag, type=kind, default=None, help=f"{what} (custom or override)")


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    return get_hardware(
        args.hardware,
        memory_gb=args.memory_gb,
        bf16_tflops=args.bf16_tflops,
        fp8_tflops=args.fp8_tflops,
        bandwidth_gbs=args.bandwidth_gbs,
        link_gbs=args.link_gbs,
        matmul_efficiency=args.efficiency,
    )


def config_from_args(args: argparse.Namespace) -> Config:
    return config_cli.config_from_args(args)


def default_gpus(placement: str) -> int:
    return 2 if placement == "pairs" else 1


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_hardware_arguments(p)
    p.add_argument("--data", help="prepared dataset dir (default: data.train if prepared)")
    p.add_argument("--samples", type=num.count(), help="documents in the training set")
    p.add_argument("--mean-tokens", type=num.positive(2**31), help="mean tokens per document")
    p.add_argument(
        "--supervised-fraction",
        type=num.fraction(open_low=True),
        help="fraction of tokens with loss",
    )
    p.add_argument(
        "--target-precision",
        choices=["bf16", "fp8", "both"],
        default="both",
        help="target weights/matmuls (default: both side by side)",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="pairs: stages one after the other (default: the trainer's prefetch overlap)",
    )
    p.add_argument("--calibrate", metavar="RUN_DIR", help="scale by a finished run's metrics")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run_plan(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    hw = hardware_from_args(args)
    placement = args.placement or cfg.distributed.placement
    gpus = args.gpus or default_gpus(placement)
    stats = data_stats(cfg, args.data, args.samples, args.mean_tokens, args.supervised_fraction)
    check_plan_data(cfg, args.data)
    cal = calibrate(args.calibrate, hw, gpus, placement, None) if args.calibrate else None
    precisions = ["bf16", "fp8"] if args.target_precision == "both" else [args.target_precision]
    preds = [
        predict(
            cfg,
            hw,
            gpus=gpus,
            placement=placement,
            data=stats,
            target_precision=p,
            overlap=False if args.no_overlap else None,
            calibration=cal,
        )
        for p in precisions
    ]
    t = cfg.training
    if args.json:
        out = {p.target_precision: p.to_dict(t.epochs, t.max_steps) for p in preds}
        print(json.dumps(out, indent=1, default=_json_default))
    else:
        print(format_plan(preds, t.epochs, t.max_steps))
    return 0


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def _fmt(x: float | None, unit: str = "", digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}{unit}"


def format_plan(preds: list[Prediction], epochs: float, max_steps: int | None) -> str:
    """The readable table: shapes, memory per GPU, time, throughput, bottleneck."""
    lines = _header(preds[0])
    lines.append(
        f"{'':34}" + "".join(f"{p.target_precision.upper() + ' target':>18}" for p in preds)
    )
    lines += _table(preds, epochs, max_steps)
    lines.append("")
    lines += _footer(preds)
    return "\n".join(lines)


def _header(p0: Prediction) -> list[str]:
    """What was planned: the cards, the models, the data and one step's shapes."""
    s = p0.shape
    return [
        f"dflash plan: {p0.hardware.name} x {p0.gpus} ({p0.placement}, data parallel {p0.data_parallel}), "
        f"compile {'on' if p0.compile else 'off'}",
        f"  target {p0.target_params / 1e9:.2f}B params, drafter {p0.drafter_params / 1e9:.3f}B params",
        f"  data: {p0.data.source}; {p0.data.documents:,} documents, mean {p0.data.mean_tokens:,.0f} tokens, "
        f"{100 * p0.data.supervised_fraction:.0f}% supervised",
        f"  step: {s.docs:.1f} docs, {s.target_tokens:,.0f} tokens ({s.target_padded_tokens:,.0f} padded in "
        f"{s.target_micro_batches:.1f} target batches), T={s.ctx_len}, N={s.anchors} anchors, "
        f"Q={s.queries}, R={s.rows:,.0f} loss rows",
        "",
    ]


def _table(preds: list[Prediction], epochs: float, max_steps: int | None) -> list[str]:
    """One row per figure, one column per target precision."""
    lines: list[str] = []

    def row(label: str, values: list[str]) -> None:
        lines.append(f"{label:34}" + "".join(f"{v:>18}" for v in values))

    row("TFLOP/step target", [_fmt(p.flops["target"] / 1e12, "", 1) for p in preds])
    row(
        "TFLOP/step drafter fwd+bwd+loss",
        [
            _fmt(
                (p.flops["drafter_forward"] + p.flops["drafter_backward"] + p.flops["loss"]) / 1e12,
                "",
                1,
            )
            for p in preds
        ],
    )
    for i, g in enumerate(preds[0].memory):
        row(
            f"memory {g.role} GPU (of {g.capacity_gb:.0f} GB)",
            [_fmt(p.memory[i].peak_gb, " GB", 1) for p in preds],
        )
        row(
            "  free after runtime reserve", [_fmt(p.memory[i].headroom_gb, " GB", 1) for p in preds]
        )
        row(
            "  compile off (unfused attention)",
            [_fmt(p.memory[i].unfused_peak_gb, " GB", 1) for p in preds],
        )
    row("time target forward", [_fmt(p.times.target, " s", 3) for p in preds])
    row("time transfer", [_fmt(p.times.transfer, " s", 3) for p in preds])
    row("time drafter fwd+loss+bwd", [_fmt(p.times.drafter, " s", 3) for p in preds])
    row("time optimizer + host", [_fmt(p.times.optimizer + p.times.host, " s", 3) for p in preds])
    row("step time", [_fmt(p.step_s, " s", 3) for p in preds])
    row("samples/s (all ranks)", [_fmt(p.samples_per_s, "", 1) for p in preds])
    row("tokens/s (all ranks)", [_fmt(p.tokens_per_s, "", 0) for p in preds])
    row(
        "steps per epoch",
        [_fmt(p.steps_per_epoch if p.data.documents else None, "", 0) for p in preds],
    )
    row("hours per epoch", [_fmt(p.hours_per_epoch, " h", 1) for p in preds])
    label = f"days for {max_steps} steps" if max_steps else f"days for {epochs:g} epochs"
    row(label, [_fmt(p.run_days(epochs, max_steps), " d", 2) for p in preds])
    return lines


def _footer(preds: list[Prediction]) -> list[str]:
    """The bottleneck per precision, the rates assumed, a calibration, the notes."""
    p0 = preds[0]
    lines = [f"bottleneck ({p.target_precision}): {p.bottleneck}" for p in preds]
    hw = p0.hardware
    fp8 = ""
    if any(p.target_precision == "fp8" for p in preds):
        fp8 = f", {hw.fp8_tflops:g} fp8 x {hw.fp8_efficiency:.3f}"
    lines.append(
        f"rates: {hw.bf16_tflops:g} TFLOP/s bf16 x {hw.matmul_efficiency:.3f} efficiency{fp8}, "
        f"{hw.bandwidth_gbs:g} GB/s x {hw.bandwidth_efficiency:.3f}, link {hw.link_gbs:g} GB/s ({hw.link_kind})"
    )
    if p0.calibration:
        c = p0.calibration
        lines.append(
            f"calibrated from {c.source} ({c.records} records, {c.target_precision} target): "
            f"target x{c.target_scale:.2f}, "
            f"drafter x{c.drafter_scale:.2f}"
            + (
                f", measured/predicted peak memory {c.peak_mem_ratio:.2f}"
                if c.peak_mem_ratio
                else ""
            )
        )
    for n in p0.notes:
        lines.append(f"note: {n}")
    return lines
