"""The project's own drafter files: `spec.json` + `drafter.safetensors` + `meta.json`.

Every training checkpoint directory, and the final `drafter/` of a run, holds these
three files; export, import and eval read them through `load_drafter`. Weights are
safetensors (never pickles); the spec is every geometry number, so a drafter is
rebuilt without its target's weights.

Run directory layout (written by the trainer):

    RUN/config.yaml            resolved config        RUN/metrics.jsonl
    RUN/run_info.json          argv, versions, SHA     RUN/checkpoints/step_00000100/
    RUN/drafter/               final drafter files     RUN/checkpoints/LATEST (name)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.atomic_dir import atomic_directory, check_replaceable
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.safetensors_check import check_finite, load_checked, save_safetensors
from dflash_trainer.input_files import inside, read_small_text
from dflash_trainer.lineage.record import LINEAGE_FILES

SPEC_FILE = "spec.json"
WEIGHTS_FILE = "drafter.safetensors"
META_FILE = "meta.json"


def save_drafter_files(
    directory: str | Path,
    spec: DrafterSpec,
    state_dict: dict[str, torch.Tensor],
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write spec, weights (contiguous CPU tensors) and meta into `directory`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    save_safetensors(tensors, d / WEIGHTS_FILE)
    (d / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=2) + "\n", encoding="utf-8")
    (d / META_FILE).write_text(
        json.dumps(meta or {}, indent=2, default=str) + "\n", encoding="utf-8"
    )
    return d


DRAFTER_FILES = frozenset({SPEC_FILE, WEIGHTS_FILE, META_FILE, *LINEAGE_FILES})


def write_drafter_dir(
    directory: str | Path,
    spec: DrafterSpec,
    state_dict: dict[str, torch.Tensor],
    meta: dict[str, Any] | None = None,
    extra: dict[str, bytes] | None = None,
) -> Path:
    """`save_drafter_files` into a directory written whole or not at all (atomic_dir).

    `extra`: more files written with them (the lineage files, lineage/record.py). An existing
    `directory` is replaced only if it holds nothing but drafter files: other files in it are
    an error, and nothing is deleted.
    """
    d = Path(directory)
    check_replaceable(d, DRAFTER_FILES.__contains__, "a drafter (spec, weights, meta)")
    unknown = sorted(set(extra or {}) - DRAFTER_FILES)
    if unknown:
        raise DFlashError(f"write_drafter_dir: {unknown} are not drafter files")
    with atomic_directory(d, replace=True) as tmp:
        save_drafter_files(tmp, spec, state_dict, meta)
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
    return d


def resolve_drafter_dir(path: str | Path) -> Path:
    """A drafter-files dir from a run dir, a checkpoint dir or the files' dir itself."""
    p = Path(path)
    if not p.exists():
        raise DFlashError(f"{p}: no such drafter, checkpoint or run directory")
    # Whatever the spec is (a FIFO, a dangling link), its reader names what is wrong with it:
    # a damaged final drafter is never passed over for a checkpoint in silence.
    if os.path.lexists(p / SPEC_FILE):
        return p
    if os.path.lexists(p / "drafter" / SPEC_FILE):
        return p / "drafter"
    latest = p / "checkpoints" / "LATEST"
    if os.path.lexists(latest):
        name = read_small_text(latest, "checkpoint pointer", 4096).strip()
        cand = inside(p / "checkpoints", name, f"{latest} names a checkpoint that")
        if os.path.lexists(cand / SPEC_FILE):
            return cand
    raise DFlashError(
        f"{p}: holds no drafter ({SPEC_FILE} + {WEIGHTS_FILE}); give a run directory, a "
        "checkpoint directory, or a z-lab/speculators export (use `dflash import` for those)"
    )


def load_drafter(path: str | Path) -> tuple[DrafterSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """(spec, fp32-or-stored-dtype state dict, meta) from a run, checkpoint or files dir."""
    d = resolve_drafter_dir(path)
    raw = _json_object(d / SPEC_FILE, "drafter spec")
    try:
        spec = DrafterSpec.from_dict(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise DFlashError(f"{d / SPEC_FILE}: not a valid drafter spec ({e!r})") from e
    if not os.path.lexists(d / WEIGHTS_FILE):
        raise DFlashError(f"{d}: {WEIGHTS_FILE} is missing")
    state = load_checked(d / WEIGHTS_FILE, root=d)
    check_finite(state, str(d / WEIGHTS_FILE))
    meta_path = d / META_FILE
    meta = _json_object(meta_path, "drafter meta") if os.path.lexists(meta_path) else {}
    _check_meta(meta, meta_path)
    return spec, state, meta


_META_SECTIONS = ("target", "source", "drafter", "training", "data", "prepared", "eval")
_TARGET_NAMES = ("name_or_path", "gguf_file", "dtype", "revision")


def _check_meta(meta: dict[str, Any], path: Path) -> None:
    """The fields of meta.json that readers use (export, eval, the model card), of their
    types: a hand-edited or damaged one is named here, not met as a crash later."""
    for key in _META_SECTIONS:
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise DFlashError(f"{path}: `{key}` is not a JSON object; restore the file")
    target = meta.get("target") or {}
    for key in _TARGET_NAMES:
        if target.get(key) is not None and not isinstance(target[key], str):
            raise DFlashError(f"{path}: `target.{key}` is not a string; restore the file")


def _json_object(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(read_small_text(path, what))
    except (ValueError, RecursionError) as e:
        raise DFlashError(f"{path}: not a valid {what} ({e}); write it again") from e
    if not isinstance(data, dict):
        raise DFlashError(f"{path}: not a valid {what} (a JSON object is expected)")
    return data


def build_drafter(path: str | Path, device: str | torch.device = "cpu") -> Any:
    """A DFlashDrafter (eval mode, fp32) with the weights found at `path`, plus its meta."""
    from dflash_trainer.core.drafter import DFlashDrafter

    spec, state, meta = load_drafter(path)
    model = DFlashDrafter(spec)
    missing, unexpected = model.load_state_dict(
        {k: v.float() for k, v in state.items()}, strict=False
    )
    if missing or unexpected:
        raise DFlashError(
            f"{path}: weights do not match the spec (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]})"
        )
    return model.to(device).eval(), meta
