"""`dflash plan`: FLOPs, memory per GPU and time of a run, before it starts.

    predict(cfg, hardware, ...) -> Prediction       importable, used by benchmarks and doctor
    calibrate(run_dir, ...)     -> Calibration      measured / predicted per side
    dataset.data_stats(...)     -> DataStats        manifest, PreparedDataset, or flags

The pieces, in data-flow order: `dataset` (what the training set holds), `workload`
(the mean shapes of a step, replayed with the trainer's own batching and anchor
rules), `flops` (counted from the configs and the target's meta-device modules),
`memory` (a saved-tensor ledger per op) and `gpu_plan` (those bytes on the cards of a
placement), `timing` (a roofline per stage), `hardware` (the cards). This module only
joins them; `report` prints. Efficiency defaults to the one measured ratio (H200 bf16
matmul); a finished run's metrics.jsonl scales the target and drafter sides separately.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trainer.config import Config, load_config
from dflash_trainer.core.geometry import DrafterSpec, resolve_drafter_spec
from dflash_trainer.errors import DFlashError
from dflash_trainer.plan.dataset import data_stats
from dflash_trainer.plan.flops import (
    AttentionCount,
    Flops,
    TargetModel,
    describe_target,
    drafter_backward_flops,
    drafter_forward_flops,
    drafter_params,
    loss_flops,
    selector_flops,
    target_forward_flops,
)
from dflash_trainer.plan.gpu_plan import GpuPlan, gpu_plans
from dflash_trainer.plan.hardware import Hardware, get_hardware
from dflash_trainer.plan.memory import Attention, DrafterMemory, drafter_memory, target_memory
from dflash_trainer.plan.timing import (
    HOST_OVERHEAD_S,
    HOST_PER_DOC_S,
    Rates,
    StageTimes,
    drafter_times,
    target_time,
)
from dflash_trainer.plan.workload import DataStats, StepShape, step_shape

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Calibration:
    """Measured / predicted step-time ratios from a finished run."""

    target_scale: float
    drafter_scale: float
    source: str
    records: int
    peak_mem_ratio: float | None = None
    """Measured peak_mem_gb / predicted drafter-GPU peak (reported, not applied)."""
    target_precision: str = "bf16"
    """The measured run's target.precision (its prediction is made with the same)."""


@dataclass(frozen=True)
class Prediction:
    """Everything `dflash plan` prints; `to_dict()` is the --json output."""

    hardware: Hardware
    gpus: int
    placement: str
    data_parallel: int
    target_precision: str
    compile: bool
    overlap: bool
    shape: StepShape
    data: DataStats
    target_params: int
    drafter_params: int
    flops: dict[str, float]
    """Per step and rank: target, drafter_forward, drafter_backward, loss, and attention variants."""
    memory: list[GpuPlan]
    times: StageTimes
    step_s: float
    calibration: Calibration | None
    micro_steps: int = 1
    """grad_accum_steps: micro-steps (shape) per optimizer step (times, steps)."""
    notes: list[str] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.data_parallel * self.micro_steps * self.shape.docs / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.data_parallel * self.micro_steps * self.shape.target_tokens / self.step_s

    @property
    def steps_per_epoch(self) -> float:
        """Optimizer steps per epoch (each rank takes its own micro-steps of documents)."""
        return self.shape.steps_per_epoch / self.data_parallel / self.micro_steps

    @property
    def hours_per_epoch(self) -> float | None:
        if not self.data.documents:
            return None
        return self.steps_per_epoch * self.step_s / 3600

    def run_days(self, epochs: float, max_steps: int | None) -> float | None:
        if max_steps is not None:
            return max_steps * self.step_s / 86400
        h = self.hours_per_epoch
        return None if h is None else epochs * h / 24

    @property
    def bottleneck(self) -> str:
        t = self.times
        misfit = [g.role for g in self.memory if not g.fits]
        if misfit:
            return f"memory: does not fit on the {', '.join(misfit)} GPU"
        parts = {
            "target forward": t.target,
            "drafter forward+backward": t.drafter_forward + t.drafter_backward,
            "lm_head + loss": t.loss,
            "gradient all-reduce (exposed)": t.allreduce_exposed,
            "GPU-to-GPU transfer": t.transfer,
            "optimizer": t.optimizer,
        }
        if self.overlap and self.placement == "pairs":
            drafter_side = t.drafter + t.optimizer
            side = "target GPU" if t.target_side >= drafter_side else "drafter GPU"
            return f"{side} ({max(parts, key=lambda k: parts[k])} is the largest stage)"
        return max(parts, key=lambda k: parts[k])

    def to_dict(self, epochs: float = 0.0, max_steps: int | None = None) -> dict[str, Any]:
        return {
            "hardware": self.hardware.to_dict(),
            "gpus": self.gpus,
            "placement": self.placement,
            "data_parallel": self.data_parallel,
            "target_precision": self.target_precision,
            "compile": self.compile,
            "overlap": self.overlap,
            "data": {
                "documents": self.data.documents,
                "mean_tokens": self.data.mean_tokens,
                "supervised_fraction": self.data.supervised_fraction,
                "source": self.data.source,
            },
            "shape": self.shape.to_dict(),
            "params": {"target": self.target_params, "drafter": self.drafter_params},
            "flops_per_step": self.flops,
            "memory": [g.to_dict() for g in self.memory],
            "times_s": self.times.to_dict(),
            "step_time_s": self.step_s,
            "logged_step_time_s": self.times.target_side + self.times.drafter,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "steps_per_epoch": self.steps_per_epoch,
            "hours_per_epoch": self.hours_per_epoch,
            "run_days": self.run_days(epochs, max_steps),
            "bottleneck": self.bottleneck,
            "calibration": dataclasses.asdict(self.calibration) if self.calibration else None,
            "notes": self.notes,
        }


# -------------------------------------------------------------------------- predict


@dataclass(frozen=True)
class _Setup:
    """The resolved inputs every part of a prediction reads."""

    cfg: Config
    hw: Hardware
    placement: str
    dp: int
    fp8: bool
    compiled: bool
    spec: DrafterSpec
    tm: TargetModel
    shape: StepShape

    @property
    def tbytes(self) -> int:
        """Bytes per element of the target's weights, features and lm_head."""
        return _BYTES.get(self.cfg.target.dtype, 2)

    @property
    def layers_run(self) -> int:
        """The target stops after its deepest tap when labels come from the data."""
        if self.cfg.training.labels == "data":
            return max(self.spec.target_layer_ids) + 1
        return self.spec.num_target_hidden_layers


@dataclass(frozen=True)
class _StepFlops:
    target: Flops
    drafter_forward: Flops
    drafter_backward: Flops
    loss: Flops


def _data_parallel(placement: str, gpus: int, target_precision: str | None) -> tuple[int, str]:
    """(data-parallel ranks, target precision) of a placement on `gpus` GPUs."""
    if placement not in ("colocated", "pairs"):
        raise DFlashError(f"placement {placement!r}: use colocated or pairs")
    per_rank = 2 if placement == "pairs" else 1
    if gpus < per_rank or gpus % per_rank:
        raise DFlashError(f"--gpus {gpus}: placement {placement} needs a multiple of {per_rank}")
    precision = target_precision or "bf16"
    if precision not in ("bf16", "fp8"):
        raise DFlashError(f"--target-precision {precision!r}: use bf16 or fp8")
    return gpus // per_rank, precision


def predict(
    cfg: Config,
    hardware: Hardware | str = "h200",
    *,
    gpus: int = 1,
    placement: str | None = None,
    data: DataStats | None = None,
    target_precision: str | None = None,
    compile: bool | None = None,
    overlap: bool | None = None,
    calibration: Calibration | None = None,
    target_hf_config: Any = None,
) -> Prediction:
    """Predicted step time (target/drafter split), memory per GPU and throughput."""
    from dflash_trainer.target.configs import load_target_config

    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    placement = placement or cfg.distributed.placement
    dp, precision = _data_parallel(placement, gpus, target_precision or cfg.target.precision)
    compiled = cfg.training.compile if compile is None else compile
    compiled = True if compiled is None else compiled  # the trainer's default on CUDA

    hf = target_hf_config if target_hf_config is not None else load_target_config(cfg.target)
    spec = resolve_drafter_spec(cfg.drafter, hf)
    tm = describe_target(hf)
    stats = data or data_stats(cfg)
    shape = step_shape(stats, cfg, spec, compiled)
    s = _Setup(cfg, hw, placement, dp, precision == "fp8", compiled, spec, tm, shape)
    counted = _step_flops(s)
    memory = _memory_plans(s)
    times = _step_times(s, counted, calibration)
    # The trainer's pairs placement prefetches the next target stage in a thread.
    do_overlap = placement == "pairs" if overlap is None else overlap and placement == "pairs"
    notes = list(tm.notes)
    if do_overlap:
        notes.append(
            "pairs: the target stage of step i+1 runs while the drafter trains step i; the "
            "trainer's step_time_s sums both stages, so it reads higher than this wall time"
        )
    return Prediction(
        hardware=hw,
        gpus=gpus,
        placement=placement,
        data_parallel=dp,
        target_precision=precision,
        compile=compiled,
        overlap=do_overlap,
        shape=shape,
        data=stats,
        target_params=tm.total_params,
        drafter_params=drafter_params(spec, cfg.drafter.selector_codebooks),
        flops=_flops_dict(s, counted),
        memory=memory,
        times=times,
        step_s=times.step(do_overlap),
        calibration=calibration,
        micro_steps=cfg.training.grad_accum_steps,
        notes=notes,
    )


def _step_flops(s: _Setup) -> _StepFlops:
    """FLOPs of one micro-step per rank; attention counted as the chosen kernel runs it."""
    t = s.cfg.training
    label_rows = s.shape.rows if (t.labels == "target" and not t.target_distribution) else 0.0
    attn_mode: AttentionCount = "tiles" if s.compiled else "dense"
    return _StepFlops(
        target=target_forward_flops(s.tm, s.shape, s.layers_run, label_rows),
        drafter_forward=drafter_forward_flops(s.spec, s.shape, attn_mode),
        drafter_backward=drafter_backward_flops(s.spec, s.shape, attn_mode, fused=s.compiled),
        loss=_loss_terms(s),
    )


def _head_loss(s: _Setup) -> str:
    """The head's cost class: ce, or kl / lk, which read the target's distribution too (so
    does an lk term beside ce)."""
    t = s.cfg.training
    return "lk" if t.target_distribution and t.loss == "ce" else t.loss


def _loss_terms(s: _Setup) -> Flops:
    """The head and its terms; DFlash2 adds the selector's scores."""
    f = loss_flops(s.spec, s.shape.rows, _head_loss(s))
    # It scores every slot.
    f.terms += selector_flops(s.spec, s.shape.queries, s.cfg.drafter.selector_codebooks).terms
    return f


def _flops_dict(s: _Setup, f: _StepFlops) -> dict[str, float]:
    flops = {
        "target": f.target.total(),
        "drafter_forward": f.drafter_forward.total(),
        "drafter_backward": f.drafter_backward.total(),
        "loss": f.loss.total(),
    }
    modes: tuple[AttentionCount, ...] = ("dense", "visible", "tiles")
    for mode in modes:
        flops[f"drafter_attention_forward_{mode}"] = drafter_forward_flops(
            s.spec, s.shape, mode
        ).total("attention")
    return flops


def _drafter_side(s: _Setup, attention: Attention, layers_compiled: bool) -> DrafterMemory:
    t = s.cfg.training
    return drafter_memory(
        s.spec,
        s.shape,
        bf16=t.precision == "bf16",
        attention=attention,
        noise=t.noise_std > 0,
        loss=_head_loss(s),
        chunk_rows=t.loss_chunk_rows,
        ddp=s.dp > 1 and s.cfg.distributed.data_parallel == "ddp",
        lm_head_bytes=s.tbytes,
        feature_bytes=s.tbytes,
        # Pairs: the trainer keeps copies of the target's lm_head and embedding table on
        # the drafter GPU; colocated, both are the target's own tensors.
        target_tables=2 if s.placement == "pairs" else 0,
        compiled=layers_compiled,
        codebooks=s.cfg.drafter.selector_codebooks,
    )


def _memory_plans(s: _Setup) -> list[GpuPlan]:
    cfg = s.cfg
    target_fsdp = cfg.distributed.target_sharding == "fsdp"
    if target_fsdp and s.placement == "pairs":
        raise DFlashError("distributed.target_sharding=fsdp needs placement=colocated")
    tmem = target_memory(
        s.tm,
        s.shape,
        len(s.spec.target_layer_ids),
        s.fp8,
        max(cfg.data.token_budget, 2 * cfg.data.doc_limit),
        cfg.training.labels == "target",
        shards=s.dp if target_fsdp else 1,
    )
    attention: Attention = "flex" if s.compiled else "math"
    return gpu_plans(
        s.hw,
        s.placement,
        tmem,
        _drafter_side(s, attention, s.compiled),
        _drafter_side(s, "math", False),
    )


def _step_times(s: _Setup, f: _StepFlops, calibration: Calibration | None) -> StageTimes:
    """Roofline seconds per stage of one optimizer step, scaled by a calibration if given."""
    t, spec, shape = s.cfg.training, s.spec, s.shape
    rates = Rates.of(s.hw)
    tsec = target_time(
        s.tm,
        f.target,
        shape.target_padded_tokens,
        s.layers_run,
        shape.target_micro_batches,
        rates,
        s.fp8,
    )
    # The elementwise traffic term (timing.drafter_times) reads the eager ledger, as when
    # it was calibrated: a compiled backward recomputes what its forward did not save,
    # so the smaller compiled ledger does not mean less elementwise work.
    dmem = _drafter_side(s, "flex" if s.compiled else "math", False)
    score_bytes = 0.0
    if not s.compiled:
        score_bytes = (
            4.0 * spec.num_attention_heads * shape.queries * shape.kv_len * spec.num_layers
        )
    f_s, l_s, b_s, o_s, ar, ar_exp = drafter_times(
        f.drafter_forward,
        f.drafter_backward,
        f.loss,
        dmem.activation_bytes,
        shape.rows * spec.vocab_size,
        _head_loss(s),
        drafter_params(spec, s.cfg.drafter.selector_codebooks),
        rates,
        s.dp,
        score_bytes,
        num_layers=spec.num_layers,
        loss_chunks=math.ceil(shape.rows / t.loss_chunk_rows),
    )
    transfer = 0.0
    if s.placement == "pairs":
        # Features, labels (and KL's target rows) go to the drafter GPU every step.
        moved = 1.0 * s.tbytes * shape.ctx_len * spec.num_context_features + 8.0 * shape.queries
        if t.target_distribution:
            moved += s.tbytes * shape.queries * spec.hidden_size
        transfer = moved / rates.link
    ts, ds = (calibration.target_scale, calibration.drafter_scale) if calibration else (1.0, 1.0)
    # An optimizer step is grad_accum_steps micro-steps (DDP reduces after each backward).
    k = t.grad_accum_steps
    return StageTimes(
        target=k * tsec * ts,
        transfer=k * transfer * ts,
        drafter_forward=k * f_s * ds,
        loss=k * l_s * ds,
        drafter_backward=k * b_s * ds,
        allreduce=k * ar,
        allreduce_exposed=k * ar_exp * ds,
        optimizer=o_s,
        host=k * (HOST_OVERHEAD_S + HOST_PER_DOC_S * shape.docs) * ts,
    )


# ------------------------------------------------------------------------- calibrate


def calibrate(
    run_dir: str | Path,
    hardware: Hardware,
    gpus: int = 1,
    placement: str | None = None,
    data: DataStats | None = None,
) -> Calibration:
    """Scale factors from RUN/metrics.jsonl (median over logged steps, the first skipped).

    The run is predicted with its own config, its target.precision included, so a run
    with an FP8 target calibrates against the FP8 prediction; `dflash plan` applies the
    same two factors to every precision it prints."""
    from dflash_trainer.json_input import is_number
    from dflash_trainer.train.run_dir import read_metrics

    def measured(value: Any) -> bool:  # a row of another shape (damage, a hand edit): skipped
        return is_number(value) and value > 0

    run = Path(run_dir)
    records = [
        r
        for r in read_metrics(run)
        if measured(r.get("target_time_s")) and measured(r.get("drafter_time_s"))
    ]
    if not records:
        raise DFlashError(
            f"--calibrate {run}: no metrics.jsonl records with target_time_s / drafter_time_s"
        )
    if len(records) > 1:
        records = records[1:]  # the first window includes compilation and warm-up
    if not (run / "config.yaml").is_file():
        raise DFlashError(f"--calibrate {run}: no config.yaml (the run's resolved config)")
    cfg = load_config(config_file=str(run / "config.yaml"))
    if data is None:
        prepared = run / "data" / "prepared"
        data = data_stats(cfg, str(prepared) if (prepared / "manifest.json").is_file() else None)
    base = predict(cfg, hardware, gpus=gpus, placement=placement, data=data)
    target_meas = statistics.median(float(r["target_time_s"]) for r in records)
    drafter_meas = statistics.median(float(r["drafter_time_s"]) for r in records)
    pred_target = base.times.target_side
    mem = [float(r["peak_mem_gb"]) for r in records if measured(r.get("peak_mem_gb"))]
    ratio = None
    if mem:
        drafter_gpu = base.memory[-1]
        ratio = max(mem) / drafter_gpu.peak_gb
    return Calibration(
        target_scale=target_meas / pred_target,
        drafter_scale=drafter_meas / base.times.drafter,
        source=str(run),
        records=len(records),
        peak_mem_ratio=ratio,
        target_precision=base.target_precision,
    )


# ------------------------------------------------------------------------------ CLI
