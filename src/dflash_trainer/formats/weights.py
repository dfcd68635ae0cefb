"""Safetensors I/O for exported drafters: one file or an HF shard index, never pickles.

Published drafters come as `model.safetensors` or as shards listed in
`model.safetensors.index.json`; a `pytorch_model.bin` is refused rather than
unpickled (loading a pickle runs code from the file).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_trainer.errors import DFlashError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def weight_files(d: Path) -> list[Path]:
    """The safetensors files holding a drafter's weights in directory `d`."""
    single, index = d / WEIGHTS_NAME, d / INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DFlashError(f"{index}: not a safetensors shard index ({e})") from e
        names = sorted(set(weight_map.values()))
        # Shard names are plain file names next to the index, never paths elsewhere.
        bad = [n for n in names if Path(n).name != n or not (d / n).is_file()]
        if bad:
            raise DFlashError(f"{index}: lists shards that are not files in {d}: {bad[:3]}")
        return [d / n for n in names]
    if (d / "pytorch_model.bin").is_file():
        raise DFlashError(
            f"{d}: has only pytorch_model.bin, a pickle this project never loads; convert "
            "it to safetensors first (safetensors.torch.save_file on a trusted machine)"
        )
    raise DFlashError(f"{d}: no {WEIGHTS_NAME} (or {INDEX_NAME} with its shards)")


def read_weights(d: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(d):
        part = load_file(str(f))
        dup = set(part) & set(tensors)
        if dup:
            raise DFlashError(f"{f}: tensors also stored in another shard: {sorted(dup)[:3]}")
        tensors.update(part)
    return tensors


def write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One file with the metadata transformers' loader requires (`format: pt`)."""
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
        str(path),
        metadata={"format": "pt"},
    )
