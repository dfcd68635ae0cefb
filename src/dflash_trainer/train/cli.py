"""`dflash train`: from a recipe or config (plus overrides), or `--resume RUN_DIR`."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dflash_trainer import cli_numbers as num
from dflash_trainer.config import Config, ConfigError, load_config
from dflash_trainer.config_cli import add_config_arguments
from dflash_trainer.errors import DFlashError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, resume=True)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build everything, run one step, print the plan, exit",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run directory that has checkpoints, deleting them "
        "(without it, that is refused: use --resume to continue)",
    )
    p.add_argument(
        "--init-from",
        metavar="DIR",
        help="continue from this drafter (a run directory, or a published or exported drafter "
        "directory): its weights and its lineage, with a fresh optimizer whose schedule "
        "warms up again (training.warmup_ratio); the same as drafter.init_from=DIR",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue even though the config changes what the run trains "
        "(target layers, block size, seed, data, token budget, accumulation, loss, ...); "
        "the changes are listed and recorded in run_info.json",
    )
    p.add_argument("--skip-doctor", action="store_true", help="do not run the pre-flight checks")
    p.add_argument(
        "--gpus",
        type=num.count(1, 65536),
        default=None,
        help="launch N ranks on this node with torchrun",
    )


def resolve_config(args: argparse.Namespace) -> Config:
    init_from = getattr(args, "init_from", None)
    if init_from:
        if args.resume:
            raise DFlashError(
                "--init-from starts a new run from a drafter's weights; --resume continues a "
                "run from its checkpoint: give one"
            )
        if not Path(init_from).exists():
            raise DFlashError(f"--init-from {init_from}: no such directory")
        args.overrides = [*args.overrides, f"drafter.init_from={init_from}"]
    if args.resume:
        cfg_path = Path(args.resume) / "config.yaml"
        if not cfg_path.is_file():
            raise DFlashError(f"--resume {args.resume}: no config.yaml there (not a run directory)")
        cfg = load_config(config_file=str(cfg_path), overrides=args.overrides)
        if Path(cfg.run.output_dir).resolve() != Path(args.resume).resolve():
            cfg = load_config(
                config_file=str(cfg_path),
                overrides=[*args.overrides, f"run.output_dir={args.resume}"],
            )
        return cfg
    if not args.recipe and not args.config:
        raise ConfigError("give --recipe NAME, --config FILE or --resume RUN_DIR")
    return load_config(recipe=args.recipe, config_file=args.config, overrides=args.overrides)


def _launch_torchrun(args: argparse.Namespace) -> int:
    """Re-run this command under torchrun with --gpus removed (argument list, no shell)."""
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    argv = sys.argv[1:]
    clean: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--gpus":
            skip = True
            continue
        if a.startswith("--gpus="):
            continue
        clean.append(a)
    cmd += [f"--nproc-per-node={args.gpus}", "-m", "dflash_trainer.cli", *clean]
    return subprocess.call(cmd, env=os.environ.copy())


def _check_ranks(n: int) -> None:
    """torchrun starts every rank at once: more ranks than this host has GPUs (or, without a
    GPU, cores) is not a run but a host out of memory, every process of it killed."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    most, what = (gpus, "GPUs") if gpus else (os.cpu_count() or 1, "CPU cores and no GPU")
    if n > most:
        raise DFlashError(f"--gpus {n}: this host has {most} {what}; give at most {most}")


def run(args: argparse.Namespace) -> int:
    if args.gpus and "RANK" not in os.environ:
        _check_ranks(args.gpus)
        return _launch_torchrun(args)
    cfg = resolve_config(args)
    if args.overwrite and args.resume:
        raise DFlashError("--overwrite starts a run over; --resume continues it: give one")
    run_dir = Path(cfg.run.output_dir) / ("dry-run" if args.dry_run else "")
    lock = None
    if os.environ.get("RANK", "0") == "0":  # rank 0 writes the run directory
        from dflash_trainer.dir_lock import acquire

        # Before the pre-flight checks spend minutes loading the target: a second
        # process on the same run directory is refused at once (the trainer re-enters it).
        lock = acquire(run_dir, "dflash train", f"run directory {run_dir}")
    try:
        return _run_locked(args, cfg)
    finally:
        if lock is not None:
            lock.release()


def _run_locked(args: argparse.Namespace, cfg: Config) -> int:
    if not args.resume and not args.dry_run:
        from dflash_trainer.train.run_dir import check_fresh_start

        # Refuse before the pre-flight checks spend minutes loading the target; the
        # trainer (rank 0) deletes the checkpoints when --overwrite asks it to.
        check_fresh_start(cfg, Path(cfg.run.output_dir), args.overwrite, False, print)
    if not args.skip_doctor and not args.resume:
        from dflash_trainer.doctor.run import run_doctor

        report = run_doctor(cfg)
        print(report.format())
        if report.failed:
            raise DFlashError(
                "the pre-flight checks failed (above); fix them or pass --skip-doctor"
            )
    from dflash_trainer.train.trainer import Trainer

    if args.dry_run:
        from dflash_trainer.config import replace

        run_dir = Path(cfg.run.output_dir) / "dry-run"
        # Its own scratch directory, checkpoints included: a configured run.checkpoint_dir
        # is the real run's, which a dry run neither cleans nor writes.
        cfg = replace(
            cfg,
            run={"output_dir": str(run_dir), "checkpoint_dir": None},
            training={"max_steps": 1},
        )
    trainer = Trainer(
        cfg,
        resume=bool(args.resume),
        argv=sys.argv,
        overwrite=args.overwrite and not args.dry_run,
        dry_run=args.dry_run,
        allow_config_change=args.allow_config_change,
    )
    if args.dry_run:
        try:
            st = trainer.train_step()
        finally:
            trainer.release()
        n_params = sum(p.numel() for p in trainer.drafter.parameters())
        print(
            f"dry run OK: target {cfg.target.name_or_path}, drafter {n_params / 1e6:.1f}M params, "
            f"{len(trainer.data.train)} train documents, {trainer.batcher.steps_per_epoch} steps "
            f"per epoch, {trainer.total_steps} steps planned; one step: loss {st.loss:.4f}, "
            f"target {st.target_s:.2f}s + drafter {st.drafter_s:.2f}s, {st.tokens} tokens"
        )
        return 0
    try:
        out = trainer.train()
    finally:
        from dflash_trainer.train.distributed import shutdown

        shutdown(trainer.world)
    return 0 if out["step"] > 0 else 1
