"""`dflash doctor`: pre-flight checks of a config against its target, on a laptop.

    run_doctor(cfg, data=..., hardware=...) -> DoctorReport     (`dflash train` calls it)

It reads configs only: the target's HF config (bundled, local or cached; never its
weights), the tokenizer when the target is local, a prepared dataset when given, and
the planner's memory model. Each check prints pass / warn / fail / skip with the fix;
any fail makes the command exit 1, so a launch script can gate on it. The checks
themselves live in doctor_checks.py; this module gathers their inputs.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_trainer.config import Config, ConfigError
from dflash_trainer.doctor import checks as C
from dflash_trainer.doctor.checks import Check
from dflash_trainer.errors import DFlashError
from dflash_trainer.plan.hardware import Hardware, get_hardware

MAX_SCAN_TOKENS = 20_000_000
"""Tokens scanned for the mask id: documents evenly spaced over the dataset up to this."""

_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    def get(self, check_id: str) -> list[Check]:
        return [c for c in self.checks if c.id == check_id]

    def format(self) -> str:
        lines = []
        for c in self.checks:
            lines.append(f"[{_MARK[c.status]}] {c.id}: {c.message}")
            if c.fix and c.status in ("warn", "fail", "skip"):
                lines.append(f"        fix: {c.fix}")
        n = {s: sum(c.status == s for c in self.checks) for s in _MARK}
        lines.append(
            f"doctor: {n['fail']} fail, {n['warn']} warn, {n['pass']} pass, {n['skip']} skipped"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"failed": self.failed, "checks": [asdict(c) for c in self.checks]}


# ------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class DataSample:
    lengths: np.ndarray
    supervised: np.ndarray | None
    docs: list[np.ndarray]
    doc_ids: list[str]
    source: str


def load_data_sample(path: str | Path, max_tokens: int = MAX_SCAN_TOKENS) -> DataSample:
    """Lengths of every document and token ids of an even sample (prepared dir or JSONL)."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        from dflash_trainer.data.shards import PreparedDataset

        ds = PreparedDataset(p, "train")
        lengths = np.asarray(ds.lengths, dtype=np.int64)
        n = len(ds)
        mean = max(1.0, float(lengths.mean())) if n else 1.0
        k = min(n, max(1, int(max_tokens // mean)))
        picks: list[int] = (
            np.unique(np.linspace(0, n - 1, k).round().astype(int)).tolist() if n else []
        )
        docs, ids = [], []
        for i in picks:
            d = ds[int(i)]
            docs.append(d.input_ids)
            ids.append(d.doc_id)
        return DataSample(lengths, ds.supervised_counts(), docs, ids, f"{p} (prepared)")
    if p.is_file():
        return _jsonl_sample(p, max_tokens)
    raise DFlashError(f"--data {p}: neither a prepared dataset (manifest.json) nor a JSONL file")


def _jsonl_sample(p: Path, max_tokens: int) -> DataSample:
    lengths, sup, docs, ids = [], [], [], []
    scanned = 0
    with p.open() as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                row = [int(x) for x in rec["input_ids"]]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise DFlashError(
                    f"{p}:{n + 1}: expected a JSON object with input_ids ({e})"
                ) from e
            lengths.append(len(row))
            mask = rec.get("loss_mask")
            sup.append(int(sum(bool(x) for x in mask)) if mask is not None else len(row))
            if scanned < max_tokens:
                docs.append(np.asarray(row))
                ids.append(str(rec.get("id", n)))
                scanned += len(row)
    return DataSample(np.asarray(lengths), np.asarray(sup), docs, ids, f"{p} (JSONL)")


def check_data(cfg: Config, sample: DataSample | None) -> list[Check]:
    from dflash_trainer.train.batching import epoch_steps

    if sample is None:
        return [
            Check(
                "data",
                "skip",
                "no data given: coverage, length and anchor checks skipped",
                "pass --data DIR",
            )
        ]
    out: list[Check] = []
    lengths = sample.lengths
    tokens = int(lengths.sum())
    if not len(lengths) or not tokens:
        return [
            Check(
                "data.documents", "fail", f"{sample.source}: no documents", "prepare the data again"
            )
        ]
    sup = sample.supervised
    if sup is not None:
        frac = float(sup.sum()) / tokens
        if frac == 0:
            out.append(
                Check(
                    "data.coverage",
                    "fail",
                    "no supervised tokens (loss mask all zero)",
                    "check the chat template / assistant masks",
                )
            )
        elif frac < 0.05:
            out.append(
                Check(
                    "data.coverage",
                    "warn",
                    f"only {100 * frac:.1f}% of tokens carry loss",
                    "check the loss masks",
                )
            )
        else:
            out.append(
                Check("data.coverage", "pass", f"{100 * frac:.1f}% of {tokens:,} tokens supervised")
            )
    limit = cfg.data.doc_limit
    over = int((lengths > limit).sum())
    if over:
        out.append(
            Check(
                "data.length",
                "warn",
                f"{over:,} of {len(lengths):,} documents exceed {limit} tokens (data.max_doc_tokens / "
                "token_budget) and will be truncated",
                "raise data.max_doc_tokens (within data.token_budget) or accept the truncation",
            )
        )
    else:
        out.append(
            Check("data.length", "pass", f"all {len(lengths):,} documents fit {limit} tokens")
        )
    if sup is not None:
        steps = epoch_steps(lengths, cfg.data.token_budget, limit, cfg.data.shuffle_seed, 0)
        ratio = np.minimum(lengths, limit) / np.maximum(lengths, 1)
        per_step = np.array([float((sup[s] * ratio[s]).sum()) for s in steps])
        med = float(np.median(per_step))
        n = cfg.training.max_anchors
        if med < n:
            out.append(
                Check(
                    "data.anchors",
                    "warn",
                    f"a step holds ~{med:.0f} supervised positions (median), fewer than "
                    f"training.max_anchors={n}: steps train on fewer blocks than configured",
                    "raise data.token_budget or lower training.max_anchors",
                )
            )
        else:
            out.append(
                Check(
                    "data.anchors",
                    "pass",
                    f"~{med:,.0f} eligible anchors per step (median) for {n} sampled",
                )
            )
    return out


# ---------------------------------------------------------------------------- memory


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
    from dflash_trainer.plan.planner import data_stats, predict
    from dflash_trainer.plan.report import default_gpus
    from dflash_trainer.plan.workload import DataStats

    how = "given"
    if hardware is None:
        hardware, how = _detect_hardware()
    placement = placement or cfg.distributed.placement
    gpus = gpus or default_gpus(placement)
    if sample is not None:
        frac = (
            float(sample.supervised.sum() / sample.lengths.sum())
            if sample.supervised is not None
            else 0.5
        )
        stats = DataStats(
            len(sample.lengths), sample.lengths, float(sample.lengths.mean()), frac, sample.source
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
    drafter_gpu = pred.memory[-1]
    if not drafter_gpu.unfused_fits:
        need = f"{drafter_gpu.unfused_peak_gb:.0f} GB"
        if cfg.training.compile is False:
            out.append(
                Check(
                    "memory.unfused",
                    "fail",
                    f"training.compile=false: unfused attention materialises fp32 scores and needs "
                    f"{need} on the {drafter_gpu.role} GPU (seed: OOM in the unfused backward)",
                    "set training.compile=true (fused FlexAttention)",
                )
            )
        else:
            out.append(
                Check(
                    "memory.unfused",
                    "pass",
                    f"compile is on; it is required here (unfused attention would need {need})",
                )
            )
    else:
        out.append(Check("memory.unfused", "pass", "even unfused attention would fit"))
    return out


# --------------------------------------------------------------------------- init_from


def check_init_from(cfg: Config, t: Any) -> list[Check]:
    """A drafter to start from must match the target's shared dims and this geometry."""
    path = cfg.drafter.init_from
    if not path:
        return []
    from dflash_trainer.core.geometry import DrafterSpec, resolve_drafter_spec
    from dflash_trainer.formats.drafter_io import SPEC_FILE, resolve_drafter_dir

    try:
        theirs = DrafterSpec.from_dict(
            json.loads((resolve_drafter_dir(path) / SPEC_FILE).read_text())
        )
    except (DFlashError, json.JSONDecodeError, TypeError, KeyError) as e:
        return [
            Check(
                "geometry.init_from",
                "skip",
                f"drafter.init_from={path}: no dflash spec.json to compare ({e})",
                "for z-lab / speculators layouts, `dflash import` it first",
            )
        ]
    try:
        mine = resolve_drafter_spec(cfg.drafter, t)
    except ConfigError:
        return []  # the geometry checks above already fail
    diffs = {
        k: (v, getattr(mine, k))
        for k, v in theirs.to_dict().items()
        if getattr(mine, k) != (tuple(v) if isinstance(v, list) else v)
    }
    if diffs:
        shown = ", ".join(f"{k}: {a} there vs {b} here" for k, (a, b) in sorted(diffs.items()))
        return [
            Check(
                "geometry.init_from",
                "fail",
                f"drafter.init_from={path} differs from this config and target: {shown}",
                "make the drafter section (and the target) match the drafter you start from",
            )
        ]
    return [Check("geometry.init_from", "pass", f"drafter.init_from={path} matches this config")]


# ---------------------------------------------------------------------------- runner


def _local_target(cfg: Config) -> bool:
    name = cfg.target.name_or_path
    return name.startswith("asset:") or Path(name).exists()


def _tokenizer(cfg: Config) -> Any:
    from dflash_trainer.data.loading import load_tokenizer
    from dflash_trainer.train.dataset import tokenizer_spec

    return load_tokenizer(tokenizer_spec(cfg.target), cfg.target.trust_remote_code)


def _generation_config(cfg: Config) -> dict[str, Any] | None:
    path = Path(cfg.target.name_or_path) / "generation_config.json"
    if path.is_file():
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    return None


def run_doctor(
    cfg: Config,
    *,
    data: str | Path | None = None,
    hardware: Hardware | str | None = None,
    gpus: int | None = None,
    placement: str | None = None,
    use_tokenizer: bool = True,
    env: dict[str, str] | None = None,
) -> DoctorReport:
    """All checks for `cfg`; `data` defaults to the prepared data.train (or RUN/data/prepared)."""
    from dflash_trainer.target.configs import load_target_config

    report = DoctorReport()
    try:
        t = load_target_config(cfg.target)
    except DFlashError as e:
        report.checks.append(Check("target.config", "fail", str(e), "give a readable target"))
        return report
    report.checks.append(
        Check(
            "target.config",
            "pass",
            f"{cfg.target.name_or_path}: {t.model_type}, {t.num_hidden_layers} layers",
        )
    )
    report.checks += C.check_geometry(cfg, t)
    report.checks += C.check_layers(cfg, t)
    report.checks += check_init_from(cfg, t)

    tokenizer, tok_note = None, ""
    if use_tokenizer and _local_target(cfg):
        try:
            tokenizer = _tokenizer(cfg)
        except Exception as e:  # a broken tokenizer must not hide the other checks
            tok_note = f" (tokenizer failed to load: {e})"
    from dflash_trainer.plan.planner import prepared_dir

    path = data or prepared_dir(cfg)
    sample = None
    if path is not None:
        try:
            sample = load_data_sample(path)
        except DFlashError as e:
            report.checks.append(
                Check(
                    "data.read",
                    "fail",
                    str(e),
                    "give a prepared dataset dir or a JSONL of input_ids",
                )
            )
    occ = None
    if sample is not None and cfg.drafter.mask_token_id is not None:
        occ = C.scan_tokens(sample.docs, cfg.drafter.mask_token_id, sample.doc_ids)
    mask_checks = C.check_mask_token(cfg, t, _generation_config(cfg), tokenizer, occ)
    if tok_note:
        mask_checks = [
            dataclass_replace(c, message=c.message + tok_note) if c.id == "mask.tokenizer" else c
            for c in mask_checks
        ]
    report.checks += mask_checks
    report.checks += C.check_rope(cfg, t)
    report.checks += C.check_sliding(cfg)
    report.checks += check_data(cfg, sample)

    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    report.checks += check_memory(cfg, t, hw, gpus, placement, sample)
    env = C.environment() if env is None else env
    place = placement or cfg.distributed.placement
    world = (gpus // (2 if place == "pairs" else 1)) if gpus else int(env.get("WORLD_SIZE", "1"))
    hybrid = "linear_attention" in (getattr(t, "layer_types", None) or [])
    cuda_expected = hw is not None or _cuda_available()
    report.checks += C.check_training(cfg, cuda_expected)
    report.checks += C.check_compile_cache(cfg, world, hybrid, env)
    return report


def dataclass_replace(c: Check, **changes: Any) -> Check:
    return Check(**{**asdict(c), **changes})


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# ------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dflash_trainer.plan.report import add_config_arguments, add_hardware_arguments

    add_config_arguments(p)
    add_hardware_arguments(p)
    p.set_defaults(hardware=None)
    p.add_argument("--data", help="prepared dataset dir or JSONL of {input_ids, loss_mask} rows")
    p.add_argument("--no-tokenizer", action="store_true", help="skip loading the target tokenizer")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")


def run(args: argparse.Namespace) -> int:
    from dflash_trainer.plan.report import config_from_args, hardware_from_args

    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        report = DoctorReport([Check("config", "fail", str(e), "fix the config field named above")])
    else:
        hw = hardware_from_args(args) if args.hardware else None
        report = run_doctor(
            cfg,
            data=args.data,
            hardware=hw,
            gpus=args.gpus,
            placement=args.placement,
            use_tokenizer=not args.no_tokenizer,
            env=dict(os.environ),
        )
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    return 1 if report.failed else 0
