"""`dflash plan`: FLOPs, memory per GPU and time of a run, before it starts.

    predict(cfg, hardware, ...) -> Prediction       importable, used by benchmarks and doctor
    data_stats(...)             -> DataStats        manifest, PreparedDataset, or flags
    calibrate(run_dir, ...)     -> Calibration      measured / predicted per side

The pieces, in data-flow order: `workload` (the mean shapes of a step, replayed with
the trainer's own batching and anchor rules), `flops` (counted from the configs and
the target's meta-device modules), `memory_model` (a saved-tensor ledger per op),
`timing` (a roofline per stage), `hardware` (the cards). This module only joins them
and prints. Efficiency defaults to the one measured ratio (H200 bf16 matmul); a
finished run's metrics.jsonl scales the target and drafter sides separately.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trainer.config import Config, load_config
from dflash_trainer.core.geometry import DrafterSpec, resolve_drafter_spec
from dflash_trainer.errors import DFlashError
from dflash_trainer.plan.flops import (
    AttentionCount,
    describe_target,
    drafter_backward_flops,
    drafter_forward_flops,
    drafter_params,
    loss_flops,
    target_forward_flops,
)
from dflash_trainer.plan.hardware import GB_UNIT, Hardware, get_hardware
from dflash_trainer.plan.memory import Attention, drafter_memory, target_memory
from dflash_trainer.plan.timing import (
    HOST_OVERHEAD_S,
    HOST_PER_DOC_S,
    Rates,
    StageTimes,
    drafter_times,
    target_time,
)
from dflash_trainer.plan.workload import DataStats, StepShape, step_shape

DEFAULT_MEAN_TOKENS = 1024
DEFAULT_SUPERVISED_FRACTION = 0.5
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


@dataclass(frozen=True)
class GpuPlan:
    role: str
    """target, drafter or colocated (both)."""
    capacity_gb: float
    peak_gb: float
    """Peak allocated bytes (what torch.cuda.max_memory_allocated reports)."""
    reserve_gb: float
    breakdown_gb: dict[str, float]
    unfused_peak_gb: float
    """The same GPU with compile off (CUDA SDPA math kernel, scores materialised)."""

    @property
    def headroom_gb(self) -> float:
        return self.capacity_gb - self.peak_gb - self.reserve_gb

    @property
    def fits(self) -> bool:
        return self.headroom_gb >= 0

    @property
    def unfused_fits(self) -> bool:
        return self.capacity_gb - self.unfused_peak_gb - self.reserve_gb >= 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(headroom_gb=self.headroom_gb, fits=self.fits, unfused_fits=self.unfused_fits)
        return d


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


# ---------------------------------------------------------------------------- data


def data_stats(
    cfg: Config,
    data: str | None = None,
    samples: int | None = None,
    mean_tokens: float | None = None,
    supervised_fraction: float | None = None,
) -> DataStats:
    """Dataset statistics: flags, else a prepared dir (--data or data.train), else an assumption."""
    if (samples is None) != (mean_tokens is None):
        raise DFlashError("give --samples and --mean-tokens together (or --data PATH)")
    if samples is not None and mean_tokens is not None:
        if samples < 1 or mean_tokens < 2:
            raise DFlashError("--samples must be >= 1 and --mean-tokens >= 2")
        frac = supervised_fraction or DEFAULT_SUPERVISED_FRACTION
        return DataStats.uniform(samples, mean_tokens, frac, "--samples/--mean-tokens")
    if data and not (Path(data) / "manifest.json").is_file():
        raise DFlashError(f"--data {data}: no manifest.json there (a `dflash data prepare` dir)")
    path = Path(data) if data else prepared_dir(cfg)
    if path is not None:
        return _prepared_stats(path, supervised_fraction)
    return DataStats.uniform(
        0,
        DEFAULT_MEAN_TOKENS,
        supervised_fraction or DEFAULT_SUPERVISED_FRACTION,
        f"assumed: documents of {DEFAULT_MEAN_TOKENS} tokens, dataset size unknown "
        "(give --data or --samples/--mean-tokens for per-epoch numbers)",
    )


def prepared_dir(cfg: Config) -> Path | None:
    """data.train when it is prepared, else what the trainer prepared in RUN/data/prepared."""
    for cand in (cfg.data.train, str(Path(cfg.run.output_dir) / "data" / "prepared")):
        if cand and (Path(cand) / "manifest.json").is_file():
            return Path(cand)
    return None


def _prepared_stats(path: Path, supervised_fraction: float | None) -> DataStats:
    manifest = json.loads((path / "manifest.json").read_text())
    train = manifest.get("splits", {}).get("train", {})
    try:
        from dflash_trainer.data.shards import PreparedDataset

        ds = PreparedDataset(path, "train")
        lengths = ds.lengths
        docs = len(ds)
        tokens = float(lengths.sum())
        sup = float(ds.supervised_counts().sum())
    except (DFlashError, ImportError, OSError, KeyError) as e:
        # Shards unreadable: the manifest's counts still give steps per epoch.
        docs = int(train.get("documents", 0))
        tokens = float(train.get("tokens", 0))
        sup = float(train.get("supervised_tokens", 0))
        lengths = None
        if not docs or not tokens:
            raise DFlashError(f"{path}: cannot read its documents ({e})") from e
    if not docs:
        raise DFlashError(f"{path}: the train split has no documents")
    frac = supervised_fraction or (sup / tokens if tokens and sup else DEFAULT_SUPERVISED_FRACTION)
    return DataStats(docs, lengths, tokens / docs, frac, f"{path}/manifest.json")


# -------------------------------------------------------------------------- predict


def _layers_run(cfg: Config, spec: DrafterSpec) -> int:
    """The target stops after its deepest tap when labels come from the data."""
    if cfg.training.labels == "data":
        return max(spec.target_layer_ids) + 1
    return spec.num_target_hidden_layers


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
    if placement not in ("colocated", "pairs"):
        raise DFlashError(f"placement {placement!r}: use colocated or pairs")
    per_rank = 2 if placement == "pairs" else 1
    if gpus < per_rank or gpus % per_rank:
        raise DFlashError(f"--gpus {gpus}: placement {placement} needs a multiple of {per_rank}")
    dp = gpus // per_rank
    precision = target_precision or "bf16"
    if precision not in ("bf16", "fp8"):
        raise DFlashError(f"--target-precision {precision!r}: use bf16 or fp8")
    fp8 = precision == "fp8"
    compiled = cfg.training.compile if compile is None else compile
    compiled = True if compiled is None else compiled  # the trainer's default on CUDA

    hf = target_hf_config if target_hf_config is not None else load_target_config(cfg.target)
    spec = resolve_drafter_spec(cfg.drafter, hf)
    tm = describe_target(hf)
    stats = data or data_stats(cfg)
    shape = step_shape(stats, cfg, spec, compiled)
    t = cfg.training
    bf16 = t.precision == "bf16"
    tbytes = _BYTES.get(cfg.target.dtype, 2)

    # FLOPs
    layers_run = _layers_run(cfg, spec)
    label_rows = shape.rows if (t.labels == "target" and t.loss == "ce") else 0.0
    tflops = target_forward_flops(tm, shape, layers_run, label_rows)
    attn_mode: AttentionCount = "tiles" if compiled else "dense"
    fwd = drafter_forward_flops(spec, shape, attn_mode)
    bwd = drafter_backward_flops(spec, shape, attn_mode, fused=compiled)
    lflops = loss_flops(spec, shape.rows, t.loss)
    flops = {
        "target": tflops.total(),
        "drafter_forward": fwd.total(),
        "drafter_backward": bwd.total(),
        "loss": lflops.total(),
    }
    modes: tuple[AttentionCount, ...] = ("dense", "visible", "tiles")
    for mode in modes:
        flops[f"drafter_attention_forward_{mode}"] = drafter_forward_flops(spec, shape, mode).total(
            "attention"
        )

    # Memory
    need_final = t.labels == "target"
    target_fsdp = cfg.distributed.target_sharding == "fsdp"
    if target_fsdp and placement == "pairs":
        raise DFlashError("distributed.target_sharding=fsdp needs placement=colocated")
    tmem = target_memory(
        tm,
        shape,
        len(spec.target_layer_ids),
        fp8,
        max(cfg.data.token_budget, 2 * cfg.data.doc_limit),
        need_final,
        shards=dp if target_fsdp else 1,
    )
    ddp = dp > 1 and cfg.distributed.data_parallel == "ddp"

    def drafter_side(attention: Attention, tables: int, layers_compiled: bool) -> Any:
        return drafter_memory(
            spec,
            shape,
            bf16=bf16,
            attention=attention,
            noise=t.noise_std > 0,
            loss=t.loss,
            chunk_rows=t.loss_chunk_rows,
            ddp=ddp,
            lm_head_bytes=tbytes,
            feature_bytes=tbytes,
            target_tables=tables,
            compiled=layers_compiled,
        )

    attention: Attention = "flex" if compiled else "math"
    # Pairs: the trainer keeps copies of the target's lm_head and embedding table on the
    # drafter GPU; colocated, both are the target's own tensors.
    tables = 2 if placement == "pairs" else 0
    memory = _gpu_plans(
        hw,
        placement,
        tmem,
        drafter_side(attention, tables, compiled),
        drafter_side("math", tables, False),
    )

    # Time
    rates = Rates.of(hw)
    tsec = target_time(
        tm, tflops, shape.target_padded_tokens, layers_run, shape.target_micro_batches, rates, fp8
    )
    # The elementwise traffic term (timing.drafter_times) reads the eager ledger, as when
    # it was calibrated: a compiled backward recomputes what its forward did not save,
    # so the smaller compiled ledger does not mean less elementwise work.
    dmem = drafter_side(attention, tables, False)
    score_bytes = 0.0
    if not compiled:
        score_bytes = (
            4.0 * spec.num_attention_heads * shape.queries * shape.kv_len * spec.num_layers
        )
    f_s, l_s, b_s, o_s, ar, ar_exp = drafter_times(
        fwd,
        bwd,
        lflops,
        dmem.activation_bytes,
        shape.rows * spec.vocab_size,
        t.loss,
        drafter_params(spec),
        rates,
        dp,
        score_bytes,
        num_layers=spec.num_layers,
        loss_chunks=math.ceil(shape.rows / t.loss_chunk_rows),
    )
    transfer = 0.0
    if placement == "pairs":
        # Features, labels (and KL's target rows) go to the drafter GPU every step.
        moved = 1.0 * tbytes * shape.ctx_len * spec.num_context_features + 8.0 * shape.queries
        if t.loss == "kl":
            moved += tbytes * shape.queries * spec.hidden_size
        transfer = moved / rates.link
    ts, ds = (calibration.target_scale, calibration.drafter_scale) if calibration else (1.0, 1.0)
    # An optimizer step is grad_accum_steps micro-steps (DDP reduces after each backward).
    k = t.grad_accum_steps
    times = StageTimes(
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
        drafter_params=drafter_params(spec),
        flops=flops,
        memory=memory,
        times=times,
        step_s=times.step(do_overlap),
        calibration=calibration,
        micro_steps=k,
        notes=notes,
    )


def _gpu_plans(
    hw: Hardware, placement: str, tmem: Any, dmem: Any, dmem_unfused: Any
) -> list[GpuPlan]:
    g = GB_UNIT
    reserve = hw.runtime_reserve_gb
    if placement == "pairs":
        target = GpuPlan(
            "target",
            hw.memory_gb,
            tmem.peak / g,
            reserve,
            {"weights": tmem.weights / g, "forward + features": tmem.forward_peak / g},
            tmem.peak / g,
        )
        drafter = GpuPlan(
            "drafter",
            hw.memory_gb,
            dmem.peak / g,
            reserve,
            _drafter_breakdown(dmem),
            dmem_unfused.peak / g,
        )
        return [target, drafter]
    # Colocated: weights stay; the target's transient and the drafter's step alternate.
    both = tmem.weights + max(tmem.forward_peak, dmem.peak)
    both_unfused = tmem.weights + max(tmem.forward_peak, dmem_unfused.peak)
    breakdown = {
        "target weights": tmem.weights / g,
        "target forward + features": tmem.forward_peak / g,
    }
    breakdown.update(_drafter_breakdown(dmem))
    return [GpuPlan("colocated", hw.memory_gb, both / g, reserve, breakdown, both_unfused / g)]


def _drafter_breakdown(dmem: Any) -> dict[str, float]:
    g = GB_UNIT
    out = {k: v / g for k, v in dmem.static.items()}
    out.update({f"input {k}": v / g for k, v in dmem.inputs.items() if v})
    out["activations (saved)"] = dmem.activation_bytes / g
    peak_phase = max(dmem.phases, key=lambda k: dmem.phases[k])
    out[f"peak phase: {peak_phase}"] = dmem.peak / g
    return out


# ------------------------------------------------------------------------- calibrate


def calibrate(
    run_dir: str | Path,
    hardware: Hardware,
    gpus: int = 1,
    placement: str | None = None,
    data: DataStats | None = None,
) -> Calibration:
    """Scale factors from RUN/metrics.jsonl (median over logged steps, the first skipped)."""
    from dflash_trainer.train.run_dir import read_metrics

    run = Path(run_dir)
    records = [r for r in read_metrics(run) if "target_time_s" in r and "drafter_time_s" in r]
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
    mem = [float(r["peak_mem_gb"]) for r in records if "peak_mem_gb" in r]
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
    )


# ------------------------------------------------------------------------------ CLI
