"""The doctor's checks of the training settings: the recommended switches, the
compile caches of several processes, and whether a step fits in GPU memory (the
planner's memory model, on the detected or given card).
"""

from __future__ import annotations

import os
from typing import Any

from dflash_trainer.config import Config, ConfigError
from dflash_trainer.doctor.data_checks import DataSample
from dflash_trainer.doctor.report import Check
from dflash_trainer.errors import DFlashError
from dflash_trainer.plan.gpu_plan import GpuPlan
from dflash_trainer.plan.hardware import Hardware, get_hardware


def check_training(cfg: Config, cuda_expected: bool) -> list[Check]:
    t = cfg.training
    out: list[Check] = []
    if t.noise_std == 0:
        out.append(
            Check(
                "training.noise",
                "warn",
                "training.noise_std=0: no noise on the drafter's copy of the context features "
                "(the recipes train with 0.05; docs/algorithm.md section 3)",
                "use training.noise_std=0.05",
            )
        )
    if not t.pack_documents:
        out.append(
            Check(
                "training.packing",
                "warn",
                "training.pack_documents=false: one drafter forward per document, ~4x slower; "
                "packing gives each document the same result (docs/algorithm.md section 3)",
                "leave packing on except for benchmarks",
            )
        )
    if cuda_expected and t.compile is False:
        out.append(
            Check(
                "training.compile",
                "warn",
                "training.compile=false on a GPU run: attention runs unfused and materialises its "
                "fp32 scores, see memory.unfused",
                "leave training.compile unset (on with CUDA)",
            )
        )
    if not out:
        out.append(Check("training.settings", "pass", "noise, packing and compile as recommended"))
    return out


def check_compile_cache(cfg: Config, world: int, hybrid: bool, env: dict[str, str]) -> list[Check]:
    if world <= 1:
        return [Check("compile.cache", "pass", "single process: one compile cache")]
    compiled = cfg.training.compile is not False
    if compiled:
        return [
            Check(
                "compile.cache",
                "pass",
                f"{world} processes: the trainer gives each rank RUN/compile_cache/rank<r> "
                "(TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) and compiles one rank at a time",
            )
        ]
    shared = env.get("TRITON_CACHE_DIR", "~/.triton/cache")
    if hybrid:
        return [
            Check(
                "compile.cache",
                "warn",
                f"{world} processes with training.compile=false share the Triton cache {shared}, "
                "while the hybrid target's Triton kernels (fla) autotune in every rank: processes "
                "writing one cache at once can corrupt it (docs/multi-gpu.md)",
                "export a per-rank TRITON_CACHE_DIR (e.g. /tmp/triton-$LOCAL_RANK) or keep compile on",
            )
        ]
    return [Check("compile.cache", "pass", f"{world} processes, nothing compiled with Triton")]


def environment() -> dict[str, str]:
    return dict(os.environ)


def _detect_hardware() -> tuple[Hardware, str]:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        name = props.name.lower()
        for key in ("h200", "h100", "b200"):
            if key in name:
                return get_hardware(
                    key, memory_gb=props.total_memory / 1e9
                ), f"detected {props.name}"
        if "rtx pro 6000" in name:
            return get_hardware("rtx-pro-6000"), f"detected {props.name}"
        return get_hardware(
            "h100", memory_gb=props.total_memory / 1e9
        ), f"detected {props.name} (rates as h100)"
    return get_hardware("h200"), "assumed h200 (no GPU here; pass --hardware)"


def check_memory(
    cfg: Config,
    target_hf: Any,
    hardware: Hardware | None,
    gpus: int | None,
    placement: str | None,
    sample: DataSample | None,
) -> list[Check]:
    from dflash_trainer.plan.dataset import data_stats
    from dflash_trainer.plan.planner import predict
    from dflash_trainer.plan.report import default_gpus
    from dflash_trainer.plan.workload import DataStats

    how = "given"
    if hardware is None:
        hardware, how = _detect_hardware()
    placement = placement or cfg.distributed.placement
    gpus = gpus or default_gpus(placement)
    # Data without documents fails data.documents; plan with the assumed documents instead
    # of dividing by zero.
    if sample is not None and int(sample.lengths.sum()):
        frac = (
            float(sample.supervised.sum() / sample.lengths.sum())
            if sample.supervised is not None
            else 0.5
        )
        stats = DataStats(
            len(sample.lengths),
            sample.lengths,
            float(sample.lengths.mean()),
            frac,
            sample.source,
            sample.first_supervised,
        )
    else:
        stats = data_stats(cfg)
    try:
        pred = predict(
            cfg, hardware, gpus=gpus, placement=placement, data=stats, target_hf_config=target_hf
        )
    except (ConfigError, DFlashError) as e:
        return [
            Check("memory.fit", "skip", f"cannot plan this config: {e}", "fix the failures above")
        ]
    out = []
    for g in pred.memory:
        line = (
            f"{g.role} GPU on {hardware.name} ({how}): {g.peak_gb:.1f} GB peak + "
            f"{g.reserve_gb:.1f} GB runtime of {g.capacity_gb:.0f} GB"
        )
        if g.fits:
            out.append(Check(f"memory.{g.role}", "pass", f"{line} ({g.headroom_gb:.1f} GB free)"))
        else:
            out.append(
                Check(
                    f"memory.{g.role}",
                    "fail",
                    f"{line}: does not fit by {-g.headroom_gb:.1f} GB",
                    "lower training.max_anchors or data.token_budget, use placement=pairs, "
                    "or a bigger card (see `dflash plan`)",
                )
            )
    out.append(_unfused(cfg, pred.memory[-1]))
    return out


def _unfused(cfg: Config, drafter_gpu: GpuPlan) -> Check:
    """Compile off runs unfused attention, whose fp32 scores may not fit in the backward."""
    if drafter_gpu.unfused_fits:
        return Check("memory.unfused", "pass", "even unfused attention would fit")
    need = f"{drafter_gpu.unfused_peak_gb:.0f} GB"
    if cfg.training.compile is False:
        return Check(
            "memory.unfused",
            "fail",
            f"training.compile=false: unfused attention materialises fp32 scores and needs "
            f"{need} on the {drafter_gpu.role} GPU: the unfused backward runs out of memory "
            "(docs/troubleshooting.md)",
            "set training.compile=true (fused FlexAttention)",
        )
    return Check(
        "memory.unfused",
        "pass",
        f"compile is on; it is required here (unfused attention would need {need})",
    )
