"""The run directory: resolved config, provenance, metrics (JSONL + TensorBoard).

Every run directory says exactly what ran: `config.yaml` (resolved, re-loadable),
`run_info.json` (argv, package versions, git SHA, host, start time) and
`metrics.jsonl`, one JSON object per logged step, the format `dflash plot` and
`dflash plan --calibrate` read.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from dflash_trainer.config import Config, config_to_dict
from dflash_trainer.errors import DFlashError
from dflash_trainer.redact import NOTE, redact_argv, redact_config
from dflash_trainer.train.checkpoint import existing_checkpoints, remove_checkpoints


def git_sha() -> str | None:
    """SHA of the dflash-trainer checkout this code runs from (None outside git)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    if out.returncode != 0 or not sha:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout.strip()
    return sha + ("-dirty" if dirty else "")


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("dflash-trainer", "torch", "transformers", "triton", "safetensors", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def write_run_files(run_dir: Path, cfg: Config, argv: list[str] | None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    # Credentials stay out of the run directory (redact.py); a note says where they go.
    data, dropped = redact_config(config_to_dict(cfg))
    note = NOTE.format(names=", ".join(dropped)) if dropped else None
    head = f"# {note}\n" if note else ""
    (run_dir / "config.yaml").write_text(head + yaml.safe_dump(data, sort_keys=False))
    info: dict[str, Any] = {
        "argv": redact_argv(list(argv if argv is not None else sys.argv)),
        "versions": package_versions(),
        "git_sha": git_sha(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = run_dir / "run_info.json"
    history = []
    if path.is_file():
        old = json.loads(path.read_text())
        history = [*old.get("history", []), {k: v for k, v in old.items() if k != "history"}]
    info["history"] = history
    if note:
        info["redacted"] = {"run.storage_options": dropped, "note": note}
    path.write_text(json.dumps(info, indent=2) + "\n")


def check_fresh_start(
    cfg: Config, run_dir: Path, overwrite: bool, is_main: bool, log: Callable[[str], None]
) -> None:
    """Refuse a fresh run over one that has checkpoints, unless `overwrite` (then clear them).

    Starting over silently would move LATEST back to the new run's first checkpoint and
    interleave two runs' rows in metrics.jsonl.
    """
    root = cfg.run.checkpoint_dir or str(run_dir / "checkpoints")
    found = existing_checkpoints(root, cfg.run.storage_options)
    if not found:
        return
    if not overwrite:
        shown = ", ".join(found[-3:])
        raise DFlashError(
            f"run.output_dir={run_dir} already holds a run with checkpoints ({root}: {shown}). "
            f"Continue it with `dflash train --resume {run_dir}`, give a new run.output_dir, "
            "or pass --overwrite to delete its checkpoints and start over"
        )
    if is_main:
        remove_checkpoints(root, cfg.run.storage_options)
        log(f"--overwrite: deleted the checkpoints in {root}; starting over")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsLog:
    """Appends JSON lines (and TensorBoard scalars when tensorboard is installed)."""

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self._tb: Any = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tb"))
            except ImportError:
                self._tb = None

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after `step` (they will be redone): the resumed checkpoint's
        step on resume, 0 on a fresh start. Rewritten atomically (a crash keeps the old
        file); a torn last line (a crash mid-append) is dropped too."""
        if not self.enabled or not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("step", 0) <= step:
                keep.append(line)
        _write_atomic(self.path, "".join(line + "\n" for line in keep))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self._tb.add_scalar(key, value, step)
                elif isinstance(value, list) and key.startswith("slot_"):
                    for k, v in enumerate(value, start=1):
                        self._tb.add_scalar(f"{key}/{k}", v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
