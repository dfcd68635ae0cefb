"""`dflash export --check`: validate an exported drafter directory.

Three groups of checks: the config on its own and against the target's HF config
(export_check_config.py), then the tensors against the names and shapes the config
implies, their dtype, and NaN/inf. The importer is lenient (it fills defaults with a
warning); this is strict, because an engine fills the same defaults silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash_trainer.core.dflash2 import is_dflash2_tensor
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.check_config import (
    DTYPES,
    CheckReport,
    ConfigView,
    Problem,
    check_geometry,
    check_numbers,
    check_target,
    check_zlab_config,
)
from dflash_trainer.formats.check_dflash2 import check_dflash2_config, check_dflash2_numbers
from dflash_trainer.formats.check_speculators import check_speculators_config
from dflash_trainer.formats.dflash2_layout import CODEBOOKS, kind_mismatch
from dflash_trainer.formats.safetensors_check import check_safetensors, load_checked, rust_path
from dflash_trainer.formats.speculators import (
    VERIFIER_TENSORS,
    VOCAB_MAP_TENSORS,
    spec_from_speculators_config,
)
from dflash_trainer.formats.weights import weight_files
from dflash_trainer.formats.zlab import expected_tensor_shapes, spec_from_zlab_config
from dflash_trainer.input_files import read_small_text

__all__ = [
    "DTYPES",
    "CheckReport",
    "Problem",
    "check_export",
    "check_import_numbers",
    "read_config",
]


# ------------------------------------------------------------------------ tensors


def _expected(
    files: list[Path], spec: DrafterSpec | None, kind: str, r: CheckReport
) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(expected shapes, names not to report one by one). Tensors of the other drafter
    kind than the config's are one error, and the rest is checked as the kind they are."""
    names: set[str] = set()
    for f in files:
        names |= set(check_safetensors(f, root=f.parent))
    mismatch = kind_mismatch(kind, names)
    if mismatch:
        r.error("architectures", *mismatch)
    if spec is None:
        return {}, set()
    if mismatch and spec.is_dflash2:  # the backbone of a DFlash drafter
        return expected_tensor_shapes(dataclasses.replace(spec, kind="dflash")), set()
    if mismatch:
        return expected_tensor_shapes(spec), {n for n in names if is_dflash2_tensor(n)}
    return expected_tensor_shapes(spec), set()


def _check_tensors(
    d: Path, spec: DrafterSpec | None, fmt: str, kind: str, cfg_dtype: Any, r: CheckReport
) -> None:
    try:
        files = weight_files(d)
        expected, skip = _expected(files, spec, kind, r)
    except DFlashError as e:
        r.error("model.safetensors", str(e), "export again with `dflash export`")
        return
    seen: set[str] = set()
    dtypes: set[torch.dtype] = set()
    for f in files:
        for name, tensor in _tensors(f):
            seen.add(name)
            if name not in skip:
                _check_one(name, tensor, expected, fmt, r)
            if name not in VERIFIER_TENSORS | VOCAB_MAP_TENSORS:
                dtypes.add(tensor.dtype)
    for name in sorted(set(expected) - seen):
        r.error(
            name,
            f"missing (shape {list(expected[name])} expected)",
            "export from the full drafter state dict",
        )
    if len(dtypes) > 1:
        r.error("tensors", f"mixed dtypes {sorted(map(str, dtypes))}", "store one dtype")
    elif dtypes and isinstance(cfg_dtype, str) and DTYPES.get(cfg_dtype) not in dtypes | {None}:
        r.error(
            "dtype",
            f"config says {cfg_dtype} but tensors are {next(iter(dtypes))}",
            "write the stored dtype in config.json",
        )


def _tensors(f: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a weights file one at a time (all at once where the safetensors library
    cannot take its path: a name that is not UTF-8)."""
    name = rust_path(f)
    if name is None:
        yield from load_checked(f).items()
        return
    with safe_open(name, framework="pt") as sf:
        for key in sf.keys():  # noqa: SIM118 (safe_open has no __iter__)
            yield key, sf.get_tensor(key)


def _check_one(
    name: str, tensor: torch.Tensor, expected: dict[str, tuple[int, ...]], fmt: str, r: CheckReport
) -> None:
    if name in VERIFIER_TENSORS:
        fix = "drop it: engines use the target's embed_tokens / lm_head"
        if fmt == "zlab":
            r.error(name, "the z-lab layout carries no embed_tokens / lm_head", fix)
        else:
            r.warn(name, "vLLM uses this copy instead of the target's own", fix)
        return
    if name in VOCAB_MAP_TENSORS:
        r.error(name, "reduced draft vocabulary mapping", "export the full vocabulary")
        return
    if expected and name not in expected and name.removesuffix(".weight") in CODEBOOKS:
        r.error(
            name,
            "a selector codebook with a .weight suffix (an nn.Embedding's state-dict name)",
            f"store it as {name.removesuffix('.weight')}: the published name has no suffix",
        )
    elif expected and name not in expected:
        r.error(
            name,
            "not part of the layout the config implies",
            "remove it (engines reject or ignore unknown weights)",
        )
    elif expected and tuple(tensor.shape) != expected[name]:
        r.error(
            name,
            f"shape {list(tensor.shape)} but the config implies {list(expected[name])}",
            "config.json and the weights disagree: re-export",
        )
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        r.error(name, "contains NaN or inf", "export an earlier checkpoint (training diverged)")


# ------------------------------------------------------------------------ entry


def read_config(d: Path) -> dict[str, Any]:
    path = d / "config.json"
    if not os.path.lexists(path):
        raise DFlashError(f"{d}: no config.json; give an exported drafter directory")
    try:
        cfg = json.loads(read_small_text(path, "drafter config"))
    except (ValueError, RecursionError) as e:
        raise DFlashError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise DFlashError(f"{path}: must hold a JSON object")
    return cfg


def check_export(
    path: str | Path, target_config: Any | None = None, special_ids: set[int] | None = None
) -> CheckReport:
    """Validate an export; `target_config` is the target's (text) HF config or None,
    `special_ids` the target's EOS/PAD ids (the mask token must not be one)."""
    d = Path(path)
    r = CheckReport(d)
    try:
        cfg = read_config(d)
    except DFlashError as e:
        r.error("config.json", str(e), "export again with `dflash export`")
        return r
    r.fmt = "speculators" if "speculators_model_type" in cfg else "zlab"
    view = check_speculators_config(cfg, r) if r.fmt == "speculators" else check_zlab_config(cfg, r)
    cfg_dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    check_geometry(view, cfg_dtype, r)
    check_dflash2_numbers(view, r)
    if target_config is not None:
        check_target(view, target_config, special_ids or set(), r)
    else:
        r.notes.append("target checks skipped (pass --target NAME_OR_PATH to run them)")
    check_dflash2_config(cfg, r.fmt, view, r)
    spec = _spec_for_shapes(cfg, r.fmt, view)
    if spec is None:
        r.notes.append("tensor names and shapes not checked: fix the config errors above first")
    _check_tensors(d, spec, r.fmt, view.kind, cfg_dtype, r)
    return r


def _spec_for_shapes(cfg: dict[str, Any], fmt: str, v: ConfigView) -> DrafterSpec | None:
    """The spec the lenient importer reads, used only for the tensor shapes."""
    try:
        if fmt == "zlab":
            return spec_from_zlab_config(cfg, "config.json")[0]
        n = v.num_target_layers or (max(v.layer_ids) + 1 if v.layer_ids else None)
        return spec_from_speculators_config(cfg, "config.json", n)[0]
    except (DFlashError, TypeError, ValueError):
        return None


def check_import_numbers(
    d: Path, cfg: dict[str, Any], target_config: Any | None = None
) -> CheckReport:
    """The numbers an import builds a drafter from (types, ranges, mask id inside the
    vocab, and the target's dims when `target_config` is known). Lenient about missing
    fields, which the importer fills; strict about wrong ones, which it cannot."""
    r = CheckReport(d)
    r.fmt = "speculators" if "speculators_model_type" in cfg else "zlab"
    layout = CheckReport(d)  # the strict layout findings are export --check's business
    view = (
        check_speculators_config(cfg, layout)
        if r.fmt == "speculators"
        else check_zlab_config(cfg, layout)
    )
    check_numbers(view, r)
    check_dflash2_numbers(view, r)
    if target_config is not None and r.ok:
        check_target(view, target_config, set(), r)
    return r
