"""Check a safetensors file's header before anything loads it.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (per tensor its
dtype, shape and [begin, end) byte offsets into the data that follows) and the data. A damaged
or hostile file lies somewhere in there: truncated data, offsets that do not match the shape,
a header length of petabytes, a link to some other file, a directory of that name. The library
reports some of these as a bare `SafetensorError` naming no file, and a header length it
believes is read into memory. So every load goes through `check_safetensors` first: it reads
at most `MAX_HEADER_BYTES` and the file's size, checks every number against the others, and
names the file and the tensor in its error. Nothing here reads the tensor data.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dflash_trainer.atomic_dir import UMASK
from dflash_trainer.errors import DFlashError, about
from dflash_trainer.input_files import check_regular, open_regular
from dflash_trainer.model_dir_check import check_config_matches_weights

MAX_HEADER_BYTES = 100 << 20
"""The safetensors library's own limit: a larger header is not one it would write."""

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FIX = "replace it with an intact copy (export, save or download it again)"


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def _hf_cache_blob(link: Path, target: Path) -> bool:
    """A Hugging Face cache snapshot links its files to `<repo>/blobs/<hash>`: allowed."""
    for parent in link.parents:
        if parent.name == "snapshots":
            return target.parent == (parent.parent / "blobs").resolve()
    return False


def _check_link(path: Path, root: Path | None) -> None:
    if not path.is_symlink():
        return
    target = path.resolve()
    if root is not None and target.is_relative_to(Path(root).resolve()):
        return
    if _hf_cache_blob(path, target):
        return
    raise DFlashError(
        f"{path} is a link to {target}, outside the drafter's directory; a weights file is "
        "read only inside the directory named (copy the file in instead of linking it)"
    )


def _fail(path: Path, what: str) -> DFlashError:
    return DFlashError(f"{path}: not a valid safetensors file: {what}; {FIX}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the header names {k!r} twice")
        out[k] = v
    return out


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header JSON, bytes of data after it), reading at most MAX_HEADER_BYTES."""
    size = check_regular(path, "weights file").st_size
    if size < 8:
        raise _fail(path, f"{size} bytes, fewer than the 8 of the header length (truncated)")
    with open_regular(path, "weights file") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            raise _fail(path, f"the header length says {n:,} bytes (at most {MAX_HEADER_BYTES:,})")
        if 8 + n > size:
            raise _fail(path, f"the header length says {n:,} bytes, the file has {size:,}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:
        raise _fail(path, f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _fail(path, "the header is not a JSON object")
    return header, size - 8 - n


def _tensor(path: Path, name: str, entry: Any) -> tuple[TensorInfo, int, int]:
    if not isinstance(entry, dict):
        raise _fail(path, f"tensor {name!r}: its header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise _fail(path, f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _fail(path, f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if need != offsets[1] - offsets[0]:
        raise _fail(
            path,
            f"tensor {name!r}: {dtype} {shape} needs {need:,} bytes, its offsets span "
            f"{offsets[1] - offsets[0]:,} (the header lies about the shape or the offsets)",
        )
    return TensorInfo(dtype, tuple(shape)), offsets[0], offsets[1]


def check_safetensors(path: str | Path, root: str | Path | None = None) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file whose header is consistent with itself and with the
    file's size, or a DFlashError naming the file and what is wrong. `root`: the directory the
    file belongs to (a link leading out of it is refused)."""
    p = Path(path)
    _check_link(p, Path(root) if root is not None else None)
    header, data_bytes = _read_header(p)
    meta = header.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise _fail(p, "__metadata__ is not a map of strings")
    spans = []
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        info, begin, end = _tensor(p, name, entry)
        tensors[name] = info
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise _fail(
                p, f"tensor {name!r} starts at byte {begin:,}, expected {at:,} (gap/overlap)"
            )
        at = end
    if at != data_bytes:
        raise _fail(
            p,
            f"the tensors need {at:,} bytes of data, the file holds {data_bytes:,} "
            + ("(truncated)" if at > data_bytes else "(trailing bytes)"),
        )
    return tensors


def check_model_weights(path: str | Path) -> None:
    """Every safetensors file of a local model directory, header-checked before a library
    maps it (a hub id or a file is left to the library)."""
    d = Path(path)
    if d.is_dir():
        shapes: dict[str, tuple[int, ...]] = {}
        for f in sorted(d.glob("*.safetensors")):
            shapes.update({k: v.shape for k, v in check_safetensors(f, root=d).items()})
        check_config_matches_weights(d, shapes)


def rust_path(path: str | Path) -> str | None:
    """`path` as the safetensors library (Rust) takes it, or None when it cannot: a name whose
    bytes are not UTF-8 has no Rust string, and under a non-UTF-8 locale (LC_ALL=C) the
    binding encodes the name with the locale's codec, which refuses any non-ASCII name."""
    raw = os.fsencode(os.fspath(path))
    try:
        name = raw.decode("utf-8")
        name.encode(sys.getfilesystemencoding())
    except (UnicodeDecodeError, UnicodeEncodeError):
        return None
    return name


def load_checked(path: str | Path, root: str | Path | None = None) -> dict[str, torch.Tensor]:
    """`safetensors.torch.load_file` after `check_safetensors` (read through Python where the
    path is not one the library can take)."""
    check_safetensors(path, root)
    with about(f"the weights file {os.fspath(path)!r}"):
        name = rust_path(path)
        if name is not None:
            return load_file(name)
        from safetensors.torch import load

        with open_regular(path, "weights file") as f:
            return load(f.read())


def check_finite(state: dict[str, torch.Tensor], where: str) -> None:
    """Refuse weights holding NaN or inf, naming the first such tensor."""
    wide = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    for name, t in state.items():
        if not t.is_floating_point():
            continue
        if not bool(torch.isfinite(t if t.dtype in wide else t.float()).all()):
            raise DFlashError(
                f"{where}: tensor {name!r} holds NaN or inf; the drafter is damaged or its "
                "training diverged: use an earlier checkpoint"
            )


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """`safetensors.torch.save_file`, then the file's mode from the umask like any other
    file the tool writes: safetensors creates it owner-only (0600), which a serving engine
    running as another user, or a shared drafter directory, cannot read."""
    from safetensors.torch import save, save_file

    name = rust_path(path)
    if name is None:  # written through Python: the library cannot take this path
        with open(path, "wb") as f:
            f.write(save(tensors, metadata=metadata))
    else:
        save_file(tensors, name, metadata=metadata)
    os.chmod(path, 0o666 & ~UMASK)
