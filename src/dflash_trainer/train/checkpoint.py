"""Atomic checkpoints, checked on resume, local disk or any fsspec URL (s3://...).

A checkpoint is a directory `step_XXXXXXXX/` holding the drafter files (drafter_io),
`optimizer.safetensors` + `optimizer.json` (tensors and the rest of AdamW's state),
`trainer_state.safetensors` (RNG states) + `trainer_state.json` (step, data position,
scheduler, counters), `checksums.json` (sha256 of every other file, written after
them) and a `COMPLETE` marker written last. `LATEST` names the newest complete
checkpoint and is replaced last, in one write:

- local disk: the directory is assembled under a temporary name and renamed into
  place, and LATEST is replaced with os.replace, so a crash (even kill -9) at any
  moment leaves the previous checkpoint as LATEST, whole;
- object stores have no rename: files are uploaded, then the checksums, then
  COMPLETE, then LATEST (a single PUT is atomic), and a checkpoint without COMPLETE
  is never loaded.

A resume checks the checksums: a damaged file (a disk that filled up, a bad copy)
makes it fall back to the newest intact checkpoint, saying so, and it refuses only
when none is intact. Checkpoints written before checksums existed are still loaded;
for them, a file that does not parse counts as damaged. LATEST is only followed to a
`step_*` name inside the checkpoint directory, and a `step_*` that is a symbolic link is
never loaded, pruned or deleted through (it is not a checkpoint this tool wrote there).

What goes into a checkpoint and back out of it (weights, optimizer, scheduler, RNG,
data position, counters) is `capture_state` / `restore_state` in train/train_state.py.

Nothing is pickled: tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import torch
from safetensors import SafetensorError

from dflash_trainer.atomic_dir import MARKER, atomic_directory, fsync_path, remove_stale
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.drafter_io import save_drafter_files
from dflash_trainer.formats.safetensors_check import save_safetensors
from dflash_trainer.input_files import check_regular, open_regular
from dflash_trainer.json_input import read_json
from dflash_trainer.train.optim import flatten_optimizer, unflatten_optimizer

LATEST = "LATEST"
COMPLETE = "COMPLETE"
CHECKSUMS = "checksums.json"
SELECTOR_FACTORS = "selector_factors.safetensors"
_STEP_NAME = re.compile(r"^step_[0-9]{8,}$")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
"""A file name in checksums.json: no directory part, so no path out of the checkpoint."""


@dataclass
class CheckpointState:
    """Everything one checkpoint holds, as the trainer hands it over."""

    step: int
    spec: DrafterSpec
    drafter_state: dict[str, torch.Tensor]
    meta: dict[str, Any]
    optimizer_state: dict[str, Any]
    trainer_state: dict[str, Any]
    rng_tensors: dict[str, torch.Tensor]
    selector_factors: dict[str, torch.Tensor] = field(default_factory=dict)
    """An embedding-mode DFlash2 selector's trained factors (core/dflash2.serving_state)."""


@dataclass
class CheckpointData:
    name: str
    location: str
    drafter_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    trainer_state: dict[str, Any]
    rng_tensors: dict[str, torch.Tensor]
    passed_over: list[str] = field(default_factory=list)
    """Newer checkpoints skipped as damaged, with the reason (empty: the latest loaded)."""
    spec: dict[str, Any] = field(default_factory=dict)
    """spec.json: the drafter's geometry."""
    meta: dict[str, Any] = field(default_factory=dict)
    """meta.json: what trained it (config sections, prepared data; train_state.run_meta)."""
    verified: bool = True
    """False: it has no checksums.json (written before checksums existed)."""
    selector_factors: dict[str, torch.Tensor] = field(default_factory=dict)
    """SELECTOR_FACTORS, when the run trained an embedding-mode selector."""


def _warn(msg: str) -> None:
    print(f"[dflash] {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    """The file's sha256; only a regular file is opened (a FIFO would block the resume)."""
    h = hashlib.sha256()
    with open_regular(path, "checkpoint file") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _damaged_files(d: Path) -> list[str] | None:
    """Files of checkpoint directory `d` whose sha256 differs from checksums.json.

    [] when all match; None when the checkpoint has no checksums.json (older code wrote
    none): its files cannot be verified. A checksums.json that is there but is not a
    regular file of sums (a dangling link, a FIFO, garbage) makes the checkpoint damaged.
    """
    manifest = d / CHECKSUMS
    if not os.path.lexists(manifest):
        return None
    try:
        sums = read_json(manifest, "checksums", max_bytes=1 << 20).get("sha256")
    except DFlashError as e:
        return [f"{CHECKSUMS} (unreadable: {e})"]
    if not isinstance(sums, dict) or not all(
        _PLAIN_NAME.match(str(k)) and isinstance(v, str) for k, v in sums.items()
    ):
        return [f"{CHECKSUMS} (not a map of this directory's file names to sha256 sums)"]
    bad = []
    for fname, want in sorted(sums.items()):
        f = d / fname
        if not os.path.lexists(f):
            bad.append(f"{fname} (missing)")
            continue
        try:
            if _sha256(f) != want:
                bad.append(f"{fname} (checksum mismatch, {f.stat().st_size} bytes)")
        except (DFlashError, OSError) as e:
            bad.append(f"{fname} ({type(e).__name__}: {e})")
    return bad


def _read_files(d: Path, name: str, location: str) -> CheckpointData:
    from dflash_trainer.formats.drafter_io import META_FILE, SPEC_FILE, WEIGHTS_FILE
    from dflash_trainer.formats.safetensors_check import load_checked

    # Headers checked before loading: a checkpoint without checksums (loaded with a warning)
    # must not make the loader read a header that lies about its size.
    drafter_state = load_checked(d / WEIGHTS_FILE, d)
    opt = unflatten_optimizer(
        load_checked(d / "optimizer.safetensors", d),
        read_json(d / "optimizer.json", "optimizer state"),
    )
    trainer_state = _checked_trainer_state(read_json(d / "trainer_state.json", "trainer state"))
    rng = load_checked(d / "trainer_state.safetensors", d)
    spec, meta = (
        read_json(d / name, what) if os.path.lexists(d / name) else {}
        for name, what in ((SPEC_FILE, "drafter spec"), (META_FILE, "checkpoint meta"))
    )
    factors = load_checked(d / SELECTOR_FACTORS, d) if os.path.lexists(d / SELECTOR_FACTORS) else {}
    return CheckpointData(
        name,
        location,
        drafter_state,
        opt,
        trainer_state,
        rng,
        spec=spec,
        meta=meta,
        selector_factors=factors,
    )


_COUNTERS = (
    *("bad_steps", "skipped_total", "truncated_total", "tokens_seen"),
    *("micro_steps", "world_size", "total_steps", "left_out_docs"),
)


def _checked_trainer_state(ts: Any) -> dict[str, Any]:
    """trainer_state.json, its fields of the right type (a ValueError names the first wrong
    one: the checkpoint counts as damaged). `step` and `position` are in every checkpoint;
    the trainer's counters are checked where present (restore_state requires them)."""
    if not isinstance(ts, dict):
        raise ValueError("trainer_state.json is not a JSON object")
    for key in ("step", *(k for k in _COUNTERS if k in ts)):
        value = ts.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"trainer_state.json: {key} is {value!r:.40}, not a count")
    pos = ts.get("position")
    if not isinstance(pos, dict) or not all(isinstance(pos.get(k), int) for k in ("epoch", "step")):
        raise ValueError(f"trainer_state.json: position is {pos!r:.80}")
    if "scheduler" in ts and not isinstance(ts["scheduler"], dict):
        raise ValueError("trainer_state.json: scheduler is not a JSON object")
    return ts


_UNREADABLE: tuple[type[Exception], ...] = (OSError, ValueError, KeyError, TypeError)
_UNREADABLE += (AttributeError, SafetensorError, DFlashError)
"""What a checkpoint file that does not parse raises (the checkpoint counts as damaged)."""


class Checkpointer:
    def __init__(
        self,
        root: str,
        keep_last: int = 3,
        storage_options: dict[str, Any] | None = None,
        log: Callable[[str], None] = _warn,
        sweep: bool = True,
    ):
        """sweep: remove what killed saves of this tool left (off for a dry run, which
        must change nothing on disk it did not create)."""
        self.root = root.rstrip("/")
        self.keep_last = keep_last
        self.log = log
        self.fs, self.path = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        self.local = isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)
        self.fs.makedirs(self.path, exist_ok=True)
        if self.local:
            for fixed in (LATEST, f".{LATEST}.tmp"):
                where = Path(self.path) / fixed
                if where.exists() and not where.is_file():
                    raise DFlashError(
                        f"{where} is not a file (a {LATEST} pointer is written there); move "
                        "it away, or give another run.checkpoint_dir"
                    )
        if self.local and sweep:
            # Only this tool's marked temporaries of dead writers: another program's
            # `.tmp-*` files, or anything else here, are never touched.
            remove_stale(Path(self.path), log=self.log)

    # ------------------------------------------------------------------ saving

    def save(self, state: CheckpointState) -> str:
        name = f"step_{state.step:08d}"
        if self.local:
            # Assembled under a temporary sibling name and renamed into place (atomic_dir).
            with atomic_directory(Path(self.path) / name, replace=True, log=self.log) as stage:
                self._write_files(stage, state)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                stage = Path(tmp) / name
                self._write_files(stage, state)
                remote = f"{self.path}/{name}"
                for f in sorted(stage.iterdir()):
                    if f.name not in (COMPLETE, CHECKSUMS):
                        self.fs.put_file(str(f), f"{remote}/{f.name}")
                self.fs.put_file(str(stage / CHECKSUMS), f"{remote}/{CHECKSUMS}")
                self.fs.put_file(str(stage / COMPLETE), f"{remote}/{COMPLETE}")
        self._write_latest(name)
        self._prune()
        return f"{self.root}/{name}"

    def _write_files(self, d: Path, state: CheckpointState) -> None:
        save_drafter_files(d, state.spec, state.drafter_state, state.meta)
        # Fault injection for the kill -9 test: a pause in the middle of a save.
        pause = float(os.environ.get("DFLASH_CHECKPOINT_PAUSE_S", "0") or 0)
        if pause:
            time.sleep(pause)
        opt_tensors, opt_meta = flatten_optimizer(state.optimizer_state)
        save_safetensors(opt_tensors, d / "optimizer.safetensors")
        (d / "optimizer.json").write_text(json.dumps(opt_meta))
        save_safetensors(
            {k: v.cpu().contiguous() for k, v in state.rng_tensors.items()},
            d / "trainer_state.safetensors",
        )
        (d / "trainer_state.json").write_text(json.dumps(state.trainer_state, indent=2))
        if state.selector_factors:
            save_safetensors(
                {k: v.cpu().contiguous() for k, v in state.selector_factors.items()},
                d / SELECTOR_FACTORS,
            )
        # Checksums of the files as written, then the marker: a checkpoint with
        # COMPLETE always has its checksums.
        sums = {f.name: _sha256(f) for f in sorted(d.iterdir()) if f.name != MARKER}
        (d / CHECKSUMS).write_text(json.dumps({"sha256": sums}, indent=2))
        # Durability is the publisher's job, once: atomic_directory fsyncs every file before
        # the rename (local); a remote store gets finished files from this staging copy.
        (d / COMPLETE).write_text("ok\n")

    def _write_latest(self, name: str) -> None:
        if self.local:
            tmp = Path(self.path) / f".{LATEST}.tmp"
            tmp.write_text(name + "\n")
            fsync_path(tmp)
            os.replace(tmp, Path(self.path) / LATEST)
            fsync_path(Path(self.path))
        else:
            with self.fs.open(f"{self.path}/{LATEST}", "w") as f:
                f.write(name + "\n")

    def list(self) -> list[str]:
        """Complete checkpoints, oldest first."""
        self.fs.invalidate_cache()  # object-store listings are cached by fsspec
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        names = sorted(Path(str(e)).name for e in entries if _STEP_NAME.match(Path(str(e)).name))
        if self.local:
            names = _without_links(self.path, names, self.log)
        return [n for n in names if self.fs.exists(f"{self.path}/{n}/{COMPLETE}")]

    def _prune(self) -> None:
        names = self.list()
        latest = self.latest()
        for old in names[: max(0, len(names) - self.keep_last)]:
            if old != latest:
                self.fs.rm(f"{self.path}/{old}", recursive=True)

    # ----------------------------------------------------------------- loading

    def latest(self) -> str | None:
        """The checkpoint LATEST names, or None (no LATEST, or a name outside this directory).

        LATEST is data on disk: only a plain `step_XXXXXXXX` name is followed, never a
        path (`../x`, `/abs`) that would load weights from outside the run.
        """
        self.fs.invalidate_cache()
        p = f"{self.path}/{LATEST}"
        if not self.fs.exists(p):
            return None
        try:
            if self.local:  # a FIFO or a device there would block or never end
                check_regular(p, LATEST)
            with self.fs.open(p, "rb") as f:
                raw = f.read(256)  # a name is ~13 bytes: never read a huge file whole
            name = raw.decode("utf-8").strip()
        except (OSError, UnicodeDecodeError, DFlashError) as e:
            self.log(
                f"{self.root}/{LATEST} is unreadable ({e}); ignoring it and using the newest "
                "complete step_* directory (the next save rewrites it)"
            )
            return None
        if not name:
            return None
        if not _STEP_NAME.match(name):
            self.log(
                f"{self.root}/{LATEST} names {name[:64]!r}, not a step_XXXXXXXX checkpoint of "
                "this directory; ignoring it and using the newest complete step_* directory"
            )
            return None
        return name

    def load(self, name: str | None = None) -> CheckpointData:
        """Checkpoint `name`, or the newest intact one (LATEST first, then older ones)."""
        if name is not None:
            if not _STEP_NAME.match(name):
                raise DFlashError(f"{self.root}: {name!r} is not a checkpoint name (step_XXXXXXXX)")
            data, damage = self._try_load(name)
            if data is None:
                raise DFlashError(f"{self.root}/{name}: damaged checkpoint: {damage}")
            return data
        candidates = self._candidates()
        if not candidates:
            raise DFlashError(
                f"{self.root}: no complete checkpoint to resume from (no {LATEST} file and no "
                f"step_* directory with a {COMPLETE} marker)"
            )
        passed_over: builtins.list[str] = []
        for cand in candidates:
            data, damage = self._try_load(cand)
            if data is not None:
                if passed_over:
                    self.log(f"resuming from {data.location}, the newest intact checkpoint")
                data.passed_over = passed_over
                return data
            passed_over.append(f"{cand}: {damage}")
            self.log(f"checkpoint {self.root}/{cand} is damaged: {damage}; trying an older one")
        raise DFlashError(
            f"{self.root}: no intact checkpoint to resume from; damaged: "
            + "; ".join(passed_over)
            + ". Restore the files from a copy, or start over with a new run.output_dir"
        )

    def _candidates(self) -> builtins.list[str]:
        """Complete checkpoints to try, best first: LATEST's, then the rest newest first."""
        complete = self.list()
        latest = self.latest()
        rest = [n for n in reversed(complete) if n != latest]
        if latest is not None and latest in complete:
            return [latest, *rest]
        if latest is not None:
            self.log(f"{self.root}/{LATEST} names {latest}, which is not a complete checkpoint")
        return rest

    def _try_load(self, name: str) -> tuple[CheckpointData | None, str]:
        """(data, "") for an intact checkpoint, else (None, which files are damaged)."""
        remote = f"{self.path}/{name}"
        if not self.fs.exists(f"{remote}/{COMPLETE}"):
            return None, f"incomplete (no {COMPLETE} marker)"
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp)
            if self.local:
                local = Path(remote)
            else:
                for f in self.fs.ls(remote, detail=False):
                    self.fs.get_file(f, str(local / Path(str(f)).name))
            bad = _damaged_files(local)
            if bad:
                return None, ", ".join(bad)
            try:
                data = _read_files(local, name, f"{self.root}/{name}")
            except _UNREADABLE as e:
                # A checkpoint without checksums (older code): a file that does not parse.
                return None, f"unreadable ({type(e).__name__}: {e})"
            if bad is None:
                data.verified = False
                self.log(
                    f"{self.root}/{name} has no {CHECKSUMS}: its weights and state are "
                    "unverified (they parse, but damage that keeps them parseable would go "
                    "unnoticed); the next checkpoint saved will have checksums"
                )
            return data, ""


def existing_checkpoints(root: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """step_* directories (complete or not) and LATEST under `root`; [] if none."""
    fs, path = fsspec.core.url_to_fs(root.rstrip("/"), **(storage_options or {}))
    fs.invalidate_cache()
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    names = (Path(str(e)).name for e in entries)
    return sorted(n for n in names if n == LATEST or _STEP_NAME.match(n))


def _without_links(path: str, names: list[str], log: Callable[[str], None]) -> list[str]:
    """`names` less the symbolic links among them (local disk), each named in `log`.

    This tool writes checkpoints as directories; a link named like one points somewhere
    else (perhaps another run) and is never loaded, pruned or deleted through.
    """
    keep = []
    for n in names:
        link = Path(path) / n
        if link.is_symlink():
            log(f"{link} is a symbolic link (to {os.readlink(link)}), not a checkpoint this "
                "tool wrote here: ignored, never loaded or deleted")  # fmt: skip
        else:
            keep.append(n)
    return keep


def remove_checkpoints(
    root: str, storage_options: dict[str, Any] | None = None, log: Callable[[str], None] = _warn
) -> None:
    """Delete the step_* directories and LATEST under `root` (an explicit start-over).

    A step_* symbolic link is left as it is, and so is what it points to."""
    fs, path = fsspec.core.url_to_fs(root.rstrip("/"), **(storage_options or {}))
    names = existing_checkpoints(root, storage_options)
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        names = [n for n in names if n == LATEST or n in _without_links(path, [n], log)]
    # LATEST first: a crash half-way leaves no pointer to a half-deleted checkpoint.
    for name in sorted(names, key=lambda n: n != LATEST):
        fs.rm(f"{path}/{name}", recursive=name != LATEST)
