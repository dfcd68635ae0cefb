"""Safetensors I/O for exported drafters: one file or an HF shard index, never pickles.

Published drafters come as `model.safetensors` or as shards listed in
`model.safetensors.index.json`; a `pytorch_model.bin` is refused rather than
unpickled (loading a pickle runs code from the file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.safetensors_check import load_checked, save_safetensors
from dflash_trainer.input_files import inside, read_small_text

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def weight_files(d: Path) -> list[Path]:
    """The safetensors files holding a drafter's weights in directory `d`."""
    single, index = d / WEIGHTS_NAME, d / INDEX_NAME
    if os.path.lexists(single):  # whatever it is: the header check names what is wrong
        return [single]
    if os.path.lexists(index):
        try:
            weight_map = json.loads(read_small_text(index, "shard index"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise DFlashError(f"{index}: not a safetensors shard index ({e})") from e
        if not all(isinstance(n, str) for n in names):
            raise DFlashError(f"{index}: shard names must be strings")
        # Shard names are plain file names next to the index, never paths elsewhere.
        return [inside(d, n, f"{index} lists a shard that") for n in names]
    if (d / "pytorch_model.bin").is_file():
        raise DFlashError(
            f"{d}: has only pytorch_model.bin, a pickle this project never loads; convert "
            "it to safetensors first (safetensors.torch.save_file on a trusted machine)"
        )
    raise DFlashError(f"{d}: no {WEIGHTS_NAME} (or {INDEX_NAME} with its shards)")


def read_weights(d: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(d):
        part = load_checked(f, root=d)
        dup = set(part) & set(tensors)
        if dup:
            raise DFlashError(f"{f}: tensors also stored in another shard: {sorted(dup)[:3]}")
        tensors.update(part)
    return tensors


def write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One file with the metadata transformers' loader requires (`format: pt`)."""
    save_safetensors(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
        path,
        metadata={"format": "pt"},
    )
