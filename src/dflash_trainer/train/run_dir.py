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
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from dflash_trainer.atomic_dir import write_file_atomic
from dflash_trainer.config import Config, config_to_dict
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import open_regular
from dflash_trainer.json_input import is_number, parse_json, read_json
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


def write_run_files(
    run_dir: Path,
    cfg: Config,
    argv: list[str] | None,
    log: Callable[[str], None] = print,
    changes: list[Any] | None = None,
) -> None:
    """config.yaml (this start's resolved config) and run_info.json (this start's provenance,
    earlier starts in `history`, and `config_changes` a resume was allowed to make).

    A damaged run_info.json is kept aside (never lost) and the history starts over, said."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # Credentials stay out of the run directory (redact.py); a note says where they go.
    data, dropped = redact_config(config_to_dict(cfg))
    note = NOTE.format(names=", ".join(dropped)) if dropped else None
    head = f"# {note}\n" if note else ""
    _write_atomic(run_dir / "config.yaml", head + yaml.safe_dump(data, sort_keys=False))
    info: dict[str, Any] = {
        "argv": redact_argv(list(argv if argv is not None else sys.argv)),
        "versions": package_versions(),
        "git_sha": git_sha(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    old = read_run_info(run_dir, log)
    if old is not None:
        history = old.get("history")
        earlier = history if isinstance(history, list) else []
        info["history"] = [*earlier, {k: v for k, v in old.items() if k != "history"}]
    else:
        info["history"] = []
    if changes:  # resume_check.Change objects
        info["config_changes"] = [c.to_dict() for c in changes]
    if note:
        info["redacted"] = {"run.storage_options": dropped, "note": note}
    _write_atomic(run_dir / "run_info.json", json.dumps(info, indent=2, default=str) + "\n")


def record_config_changes(
    run_dir: Path, changes: list[dict[str, Any]], log: Callable[[str], None] = print
) -> None:
    """Add config changes found after the start (against the checkpoint) to run_info.json."""
    info = read_run_info(run_dir, log) or {}
    info["config_changes"] = [*info.get("config_changes", []), *changes]
    _write_atomic(run_dir / "run_info.json", json.dumps(info, indent=2, default=str) + "\n")


RUN_INFO_BYTES = 16 << 20
"""run_info.json grows by one start's provenance (~1 kB) per resume."""


def read_run_info(run_dir: Path, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """run_info.json as a dict; None if absent. A damaged one is renamed aside, said."""
    path = run_dir / "run_info.json"
    if not os.path.lexists(path):
        return None
    try:  # a regular file of a JSON object (a FIFO is damage, never waited on)
        return dict(read_json(path, "run info", max_bytes=RUN_INFO_BYTES))
    except DFlashError as e:
        why = str(e).removeprefix(f"run info {path}").lstrip(": ")[:200]
    aside = path.with_name(f"run_info.json.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.replace(path, aside)
    except OSError as e:
        raise DFlashError(
            f"{path} is damaged ({why}) and cannot be moved aside ({e.strerror or e}); move "
            "it away yourself"
        ) from e
    log(f"{path} was damaged ({why}); kept as {aside.name}, the run's history starts over")
    return None


RUN_FILES = ("config.yaml", "run_info.json", "metrics.jsonl", "drafter")
"""What a run leaves in its directory (checkpoints aside): any of them marks it used."""


def check_fresh_start(
    cfg: Config, run_dir: Path, overwrite: bool, is_main: bool, log: Callable[[str], None]
) -> None:
    """Refuse a fresh run in a used run directory, unless `overwrite` (then clear it).

    Used: it has checkpoints (in run.checkpoint_dir) or any of RUN_FILES. Starting over
    silently would move LATEST back to the new run's first checkpoint, interleave two runs'
    rows in metrics.jsonl and leave the old run's drafter beside the new run's numbers.
    `overwrite` deletes the checkpoints and the final drafter (metrics.jsonl is cut back to
    nothing by the trainer, config.yaml and run_info.json are rewritten, keeping history).
    """
    root = cfg.run.checkpoint_dir or str(run_dir / "checkpoints")
    found = existing_checkpoints(root, cfg.run.storage_options)
    used = [n for n in RUN_FILES if (run_dir / n).exists() or (run_dir / n).is_symlink()]
    if not found and not used:
        return
    if not found and _start_that_trained_nothing(run_dir, used):
        log(
            f"{run_dir}: the start recorded there trained no step (no checkpoint, metrics row "
            "or drafter); starting again in it"
        )
        return
    if not overwrite:
        held = used + ([f"checkpoints in {root}: " + ", ".join(found[-3:])] if found else [])
        raise DFlashError(
            f"run.output_dir={run_dir} already holds a run ({'; '.join(held)}). "
            f"Continue it with `dflash train --resume {run_dir}`, give a new run.output_dir, "
            "or pass --overwrite to delete its checkpoints and final drafter and start over"
        )
    if not is_main:
        return
    if found:
        remove_checkpoints(root, cfg.run.storage_options, log)
        log(f"--overwrite: deleted the checkpoints in {root}; starting over")
    drafter = run_dir / "drafter"
    if drafter.exists() or drafter.is_symlink():
        from dflash_trainer.atomic_dir import check_replaceable
        from dflash_trainer.formats.drafter_io import DRAFTER_FILES

        check_replaceable(drafter, DRAFTER_FILES.__contains__, "the run's final drafter")
        shutil.rmtree(drafter)
        log(f"--overwrite: deleted the previous run's final drafter {drafter}")


def _start_that_trained_nothing(run_dir: Path, used: list[str]) -> bool:
    """Whether the directory holds only what a start writes before its first step (its
    config.yaml and run_info.json, an empty metrics.jsonl): a run that failed before training
    anything, which the same command may start again. A config.yaml alone is not enough (a
    user's own file of that name); run_info.json is this tool's."""
    if "run_info.json" not in used or not set(used) <= {
        "config.yaml",
        "run_info.json",
        "metrics.jsonl",
    }:
        return False
    files = [run_dir / n for n in used]
    if any(p.is_symlink() or not p.is_file() for p in files):
        return False
    metrics = run_dir / "metrics.jsonl"
    return not metrics.exists() or metrics.stat().st_size == 0


def _write_atomic(path: Path, text: str) -> None:
    write_file_atomic(path, text)


class MetricsLog:
    """Appends JSON lines (and TensorBoard scalars when tensorboard is installed)."""

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self._tb: Any = None
        tb = run_dir / "tb"
        if enabled and (tb.is_symlink() or (os.path.lexists(tb) and not tb.is_dir())):
            # Not the run's own folder (a link out of the run, a file): never written through.
            print(f"[dflash] {tb} is not a directory of the run (a link or a file): no "
                  "TensorBoard events this time (metrics.jsonl has every number)", file=sys.stderr)  # fmt: skip
        elif enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(tb))
            except ImportError:
                self._tb = None

    def truncate_after(self, step: int) -> int:
        """Drop rows logged after `step` (they will be redone): the resumed checkpoint's
        step on resume, 0 on a fresh start. Rewritten atomically (a crash keeps the old
        file). Damaged rows (a torn last line after a crash, bytes that are not a JSON
        object with a numeric step) are dropped too; returns how many."""
        if not self.enabled or not os.path.lexists(self.path):
            return 0
        if self.path.is_symlink() or not self.path.is_file():
            raise DFlashError(
                f"{self.path} is not a file (a link, a directory or a FIFO); move it away (the "
                "run's metrics are written there)"
            )
        keep, damaged = [], 0
        for line in _lines(self.path):
            row = _metrics_row(line)
            if row is None:
                damaged += line.strip() != ""
            elif row.get("step", 0) <= step:
                keep.append(line)
        _write_atomic(self.path, "".join(line + "\n" for line in keep))
        return damaged

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


def _lines(path: Path) -> Iterator[str]:
    """The lines of a regular file (a FIFO is refused, never waited on), undecodable bytes
    replaced: one damaged row costs that row only."""
    with open_regular(path, "metrics file") as f:
        for raw in f:
            yield raw.decode("utf-8", errors="replace").rstrip("\r\n")


def _metrics_row(line: str) -> dict[str, Any] | None:
    """A metrics.jsonl line as its row, or None if damaged (not a JSON object with a finite
    step, or nested like no row is)."""
    try:
        row = parse_json(line, "metrics row", dict)
    except DFlashError:
        return None
    return row if is_number(row.get("step", 0)) else None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of RUN/metrics.jsonl (damaged lines left out); [] without one. A metrics file
    that is not a regular file (a FIFO, a directory) is an error naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        os.lstat(path)  # other errors (a name too long, a file as a directory) are said
    except FileNotFoundError:
        return []
    return [row for row in map(_metrics_row, _lines(path)) if row is not None]


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows whose `key` is a finite number: a row of the wrong shape
    (written by hand, another version, damage) is left out of the curve, not a crash."""
    pairs = [(r["step"], r[key]) for r in rows if is_number(r.get(key)) and "step" in r]
    return [float(s) for s, _ in pairs], [float(v) for _, v in pairs]
