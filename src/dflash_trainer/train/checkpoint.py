"""Atomic checkpoints, exact resume, local disk or any fsspec URL (s3://...).

A checkpoint is a directory `step_XXXXXXXX/` holding the drafter files (drafter_io),
`optimizer.safetensors` + `optimizer.json` (tensors and the rest of AdamW's state),
`trainer_state.safetensors` (RNG states) + `trainer_state.json` (step, data position,
scheduler, counters), and a `COMPLETE` marker written last. `LATEST` names the
newest complete checkpoint and is replaced last, in one write:

- local disk: the directory is assembled under a temporary name and renamed into
  place, and LATEST is replaced with os.replace, so a crash (even kill -9) at any
  moment leaves the previous checkpoint as LATEST, whole;
- object stores have no rename: files are uploaded, then COMPLETE, then LATEST (a
  single PUT is atomic), and a checkpoint without COMPLETE is never loaded.

Nothing is pickled: tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
from safetensors.torch import load_file, save_file

from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.drafter_io import save_drafter_files

LATEST = "LATEST"
COMPLETE = "COMPLETE"


def _flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    # Keys are parameter indices (plain optimizers) or names with dots (FSDP full state
    # dicts): "/" separates them from the state field, and the key kind is recorded.
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    int_keys = all(isinstance(k, int) for k in sd["state"])
    for idx, st in sd["state"].items():
        for key, val in st.items():
            if torch.is_tensor(val):
                tensors[f"state/{idx}/{key}"] = val.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = val
    meta = {"param_groups": sd["param_groups"], "scalars": scalars, "int_keys": int_keys}
    return tensors, meta


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    as_key: Any = int if meta.get("int_keys", True) else str
    state: dict[Any, dict[str, Any]] = {}
    for name, t in tensors.items():
        head, key = name.rsplit("/", 1)
        state.setdefault(as_key(head.split("/", 1)[1]), {})[key] = t
    for idx, vals in meta.get("scalars", {}).items():
        state.setdefault(as_key(idx), {}).update(vals)
    return {"state": state, "param_groups": meta["param_groups"]}


@dataclass
class CheckpointData:
    name: str
    location: str
    drafter_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    trainer_state: dict[str, Any]
    rng_tensors: dict[str, torch.Tensor]


class Checkpointer:
    def __init__(
        self, root: str, keep_last: int = 3, storage_options: dict[str, Any] | None = None
    ):
        self.root = root.rstrip("/")
        self.keep_last = keep_last
        self.fs, self.path = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        self.local = isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)
        self.fs.makedirs(self.path, exist_ok=True)
        if self.local:
            for stale in Path(self.path).glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: int,
        spec: DrafterSpec,
        drafter_state: dict[str, torch.Tensor],
        meta: dict[str, Any],
        optimizer_state: dict[str, Any],
        trainer_state: dict[str, Any],
        rng_tensors: dict[str, torch.Tensor],
    ) -> str:
        name = f"step_{step:08d}"
        with tempfile.TemporaryDirectory(
            dir=self.path if self.local else None, prefix=".tmp-"
        ) as tmp:
            stage = Path(tmp) / name
            self._write_files(
                stage, spec, drafter_state, meta, optimizer_state, trainer_state, rng_tensors
            )
            if self.local:
                final = Path(self.path) / name
                if final.exists():
                    shutil.rmtree(final)
                os.rename(stage, final)
                _fsync_dir(Path(self.path))
            else:
                remote = f"{self.path}/{name}"
                for f in sorted(stage.iterdir()):
                    if f.name != COMPLETE:
                        self.fs.put_file(str(f), f"{remote}/{f.name}")
                self.fs.put_file(str(stage / COMPLETE), f"{remote}/{COMPLETE}")
        self._write_latest(name)
        self._prune()
        return f"{self.root}/{name}"

    def _write_files(
        self,
        d: Path,
        spec: DrafterSpec,
        drafter_state: dict[str, torch.Tensor],
        meta: dict[str, Any],
        optimizer_state: dict[str, Any],
        trainer_state: dict[str, Any],
        rng_tensors: dict[str, torch.Tensor],
    ) -> None:
        save_drafter_files(d, spec, drafter_state, meta)
        # Fault injection for the kill -9 test: a pause in the middle of a save.
        pause = float(os.environ.get("DFLASH_CHECKPOINT_PAUSE_S", "0") or 0)
        if pause:
            time.sleep(pause)
        opt_tensors, opt_meta = _flatten_optimizer(optimizer_state)
        save_file(opt_tensors, str(d / "optimizer.safetensors"))
        (d / "optimizer.json").write_text(json.dumps(opt_meta))
        save_file(
            {k: v.cpu().contiguous() for k, v in rng_tensors.items()},
            str(d / "trainer_state.safetensors"),
        )
        (d / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        for f in d.iterdir():
            _fsync_file(f)
        (d / COMPLETE).write_text("ok\n")
        _fsync_file(d / COMPLETE)

    def _write_latest(self, name: str) -> None:
        if self.local:
            tmp = Path(self.path) / f".{LATEST}.tmp"
            tmp.write_text(name + "\n")
            _fsync_file(tmp)
            os.replace(tmp, Path(self.path) / LATEST)
            _fsync_dir(Path(self.path))
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
        names = sorted(Path(str(e)).name for e in entries if Path(str(e)).name.startswith("step_"))
        return [n for n in names if self.fs.exists(f"{self.path}/{n}/{COMPLETE}")]

    def _prune(self) -> None:
        names = self.list()
        latest = self.latest()
        for old in names[: max(0, len(names) - self.keep_last)]:
            if old != latest:
                self.fs.rm(f"{self.path}/{old}", recursive=True)

    # ----------------------------------------------------------------- loading

    def latest(self) -> str | None:
        self.fs.invalidate_cache()
        p = f"{self.path}/{LATEST}"
        if not self.fs.exists(p):
            return None
        with self.fs.open(p, "r") as f:
            name = str(f.read()).strip()
        return name or None

    def load(self, name: str | None = None) -> CheckpointData:
        name = name or self.latest()
        if name is None:
            raise DFlashError(f"{self.root}: no checkpoint to resume from (no {LATEST} file)")
        remote = f"{self.path}/{name}"
        if not self.fs.exists(f"{remote}/{COMPLETE}"):
            raise DFlashError(f"{self.root}/{name}: incomplete checkpoint (no {COMPLETE} marker)")
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp)
            if self.local:
                local = Path(remote)
            else:
                for f in self.fs.ls(remote, detail=False):
                    self.fs.get_file(f, str(local / Path(str(f)).name))
            from dflash_trainer.formats.drafter_io import WEIGHTS_FILE

            drafter_state = load_file(str(local / WEIGHTS_FILE))
            opt = _unflatten_optimizer(
                load_file(str(local / "optimizer.safetensors")),
                json.loads((local / "optimizer.json").read_text()),
            )
            trainer_state = json.loads((local / "trainer_state.json").read_text())
            rng = load_file(str(local / "trainer_state.safetensors"))
        return CheckpointData(name, f"{self.root}/{name}", drafter_state, opt, trainer_state, rng)


def _fsync_file(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
