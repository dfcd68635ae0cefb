"""`dflash doctor`: pre-flight checks of a config against its target, on a laptop.

    run_doctor(cfg, data=..., hardware=...) -> DoctorReport     (`dflash train` calls it)

It reads configs only: the target's HF config (bundled, local or cached; never its
weights), the tokenizer when the target is local, a prepared dataset when given, and
the planner's memory model. Each check prints pass / warn / fail / skip with the fix;
any fail makes the command exit 1, so a launch script can gate on it. The checks live
in modules named after what they check (geometry_checks, token_checks, context_checks,
data_checks, training_checks); this module gathers their inputs and runs them in order.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash_trainer.config import Config, ConfigError
from dflash_trainer.doctor.context_checks import check_rope, check_sliding
from dflash_trainer.doctor.data_checks import DataSample, check_data, load_data_sample
from dflash_trainer.doctor.geometry_checks import (
    check_dflash2,
    check_geometry,
    check_init_from,
    check_layers,
)
from dflash_trainer.doctor.precision_checks import check_target_precision
from dflash_trainer.doctor.report import Check, DoctorReport
from dflash_trainer.doctor.token_checks import check_mask_token, scan_tokens
from dflash_trainer.doctor.training_checks import (
    check_compile_cache,
    check_memory,
    check_training,
    environment,
)
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import read_small_text
from dflash_trainer.plan.hardware import Hardware, get_hardware


def _local_target(cfg: Config) -> bool:
    name = cfg.target.name_or_path
    return name.startswith("asset:") or Path(name).exists()


def _tokenizer(cfg: Config) -> Any:
    from dflash_trainer.data.loading import load_tokenizer, tokenizer_spec

    return load_tokenizer(tokenizer_spec(cfg.target), cfg.target.trust_remote_code)


def _generation_config(cfg: Config) -> dict[str, Any] | None:
    path = Path(cfg.target.name_or_path) / "generation_config.json"
    if path.is_file():
        try:
            data = json.loads(read_small_text(path, "generation config"))
        except (ValueError, RecursionError) as e:
            raise DFlashError(f"{path}: not valid JSON ({e}); fix or remove the file") from e
        return data if isinstance(data, dict) else None
    return None


def _data_sample(cfg: Config, data: str | Path | None, report: DoctorReport) -> DataSample | None:
    """`data`, else the prepared data.train (or RUN/data/prepared); a read error is a fail."""
    from dflash_trainer.plan.dataset import prepared_dir

    path = data or prepared_dir(cfg)
    if path is None:
        return None
    try:
        return load_data_sample(path)
    except DFlashError as e:
        report.checks.append(
            Check(
                "data.read",
                "fail",
                str(e),
                "give a prepared dataset dir or a JSONL of input_ids",
            )
        )
        return None


def _load_tokenizer(cfg: Config, use_tokenizer: bool) -> tuple[Any, str]:
    """(the target's tokenizer or None, why it is None when it failed to load)."""
    if use_tokenizer and _local_target(cfg):
        try:
            return _tokenizer(cfg), ""
        except Exception as e:  # a broken tokenizer must not hide the other checks
            return None, f" (tokenizer failed to load: {e})"
    return None, ""


def _prepared_tokenizer_checks(
    cfg: Config, t: Any, data: str | Path | None, tokenizer: Any
) -> list[Check]:
    """The prepared data's recorded tokenizer and token ids against the target's."""
    from dflash_trainer.data.shards import read_manifest
    from dflash_trainer.data.tokenizer_check import findings
    from dflash_trainer.plan.dataset import prepared_dir

    path = Path(data) if data else prepared_dir(cfg)
    if path is None or not (path / "manifest.json").is_file():
        return []
    try:
        manifest = read_manifest(path)
        found = findings(path, manifest, cfg.target.name_or_path, int(t.vocab_size), tokenizer)
    except DFlashError:
        return []  # data.read reports the damage
    if not found:
        note = "" if tokenizer is not None else " (tokenizer not loaded: ids checked only)"
        found = [("pass", f"{path}: token ids inside the target's vocabulary{note}", "")]
    return [Check("data.tokenizer", status, message, fix) for status, message, fix in found]


def _mask_checks(
    cfg: Config, t: Any, tokenizer: Any, tok_note: str, sample: DataSample | None
) -> list[Check]:
    occ = None
    if sample is not None and cfg.drafter.mask_token_id is not None:
        occ = scan_tokens(sample.docs, cfg.drafter.mask_token_id, sample.doc_ids)
    checks = check_mask_token(cfg, t, _generation_config(cfg), tokenizer, occ)
    if tok_note:
        checks = [
            replace(c, message=c.message + tok_note) if c.id == "mask.tokenizer" else c
            for c in checks
        ]
    return checks


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
        fix = (
            "remove or rename the override: it must be a field of the target's config class"
            if "hf_config_overrides" in str(e)
            else "point target.name_or_path at a readable model directory, hub id or asset"
        )
        report.checks.append(Check("target.config", "fail", str(e), fix))
        return report
    report.checks.append(
        Check(
            "target.config",
            "pass",
            f"{cfg.target.name_or_path}: {t.model_type}, {t.num_hidden_layers} layers",
        )
    )
    report.checks += check_geometry(cfg, t)
    report.checks += check_layers(cfg, t)
    report.checks += check_init_from(cfg, t)
    report.checks += check_dflash2(cfg, t)
    sample = _data_sample(cfg, data, report)
    tokenizer, tok_note = _load_tokenizer(cfg, use_tokenizer)
    report.checks += _prepared_tokenizer_checks(cfg, t, data, tokenizer)
    report.checks += _mask_checks(cfg, t, tokenizer, tok_note, sample)
    report.checks += check_rope(cfg, t)
    report.checks += check_sliding(cfg)
    report.checks += check_data(cfg, sample)

    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    report.checks += check_memory(cfg, t, hw, gpus, placement, sample)
    env = environment() if env is None else env
    place = placement or cfg.distributed.placement
    world = (gpus // (2 if place == "pairs" else 1)) if gpus else int(env.get("WORLD_SIZE", "1"))
    hybrid = "linear_attention" in (getattr(t, "layer_types", None) or [])
    cuda_expected = hw is not None or _cuda_available()
    report.checks += check_training(cfg, cuda_expected)
    report.checks += check_target_precision(cfg, hw, _cuda_available())
    report.checks += check_compile_cache(cfg, world, hybrid, env)
    return report


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
