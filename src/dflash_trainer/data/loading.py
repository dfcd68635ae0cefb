"""Resolve user specs: data sources, tokenizers and (for regeneration) causal LMs.

Accepted specs, for tokenizers and models alike:
- `asset:<name>`: an offline asset (docs/assets.md), e.g. `asset:smollm2-135m-instruct` (a GGUF);
- a `.gguf` file, or `DIR::FILE.gguf` (a directory plus the GGUF file in it);
- a local directory with tokenizer/model files;
- anything else is a Hugging Face hub id.
Remote code is never run unless the caller passes trust_remote_code=True: a hub id is text typed
by a user, and a tokenizer should not be a way to run someone else's Python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_trainer import gguf_cache
from dflash_trainer.assets import AssetNotFound, asset_path
from dflash_trainer.data.jsonio import HFDataset, require_datasets
from dflash_trainer.errors import DFlashError, about
from dflash_trainer.model_dir_check import check_model_files


def tokenizer_spec(tcfg: Any) -> str:
    """A target config's tokenizer in this module's spec syntax (`DIR::FILE.gguf` for GGUF)."""
    if tcfg.gguf_file:
        return f"{tcfg.name_or_path}::{tcfg.gguf_file}"
    return str(tcfg.name_or_path)


def split_spec(spec: str | Path) -> tuple[str, str | None]:
    """(directory or hub id, gguf file name or None)."""
    text = str(spec)
    if text.startswith("asset:"):
        try:
            path = asset_path(text[len("asset:") :])
        except AssetNotFound as e:
            raise DFlashError(str(e)) from e
        text = str(path)
    if "::" in text:
        directory, gguf = text.split("::", 1)
        return directory, gguf
    p = Path(text)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise DFlashError(f"GGUF file {p} does not exist")
        return str(p.parent), p.name
    return text, None


def resolve_source(spec: str | Path | HFDataset) -> Path | HFDataset:
    """A data source: a local path, or a Hugging Face dataset name.

    `asset:<name>` -> the asset's path; `hf:<name>[:split]` -> the dataset name; an existing
    path -> itself; a missing path with a file suffix or a path separator -> an error;
    anything else (`org/name`) is taken as a dataset name.
    """
    if isinstance(spec, HFDataset):
        require_datasets(spec.name)
        return spec
    text = str(spec)
    if text.startswith("asset:"):
        try:
            return asset_path(text[len("asset:") :])
        except AssetNotFound as e:
            raise DFlashError(str(e)) from e
    if text.startswith("hf:"):
        require_datasets(text[len("hf:") :])
        return HFDataset(text[len("hf:") :])
    p = Path(text).expanduser()
    if p.exists():
        return p
    looks_local = p.suffix != "" or text.startswith((".", "/", "~")) or text.count("/") > 1
    if looks_local:
        raise DFlashError(f"input {text} does not exist (for a Hugging Face dataset use hf:NAME)")
    require_datasets(text)  # fail now, not after loading a tokenizer
    return HFDataset(text)


def load_tokenizer(spec: Any, trust_remote_code: bool = False) -> Any:
    """A tokenizer object is returned as is; a spec string is loaded (see module docstring)."""
    if not isinstance(spec, str | Path):
        return spec
    from transformers import AutoTokenizer

    where, gguf = split_spec(spec)
    check_model_files(where, f"tokenizer {spec}")
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf is not None:
        kwargs["gguf_file"] = gguf
    try:
        with about(f"the tokenizer {str(spec)!r}"):
            if gguf is not None and gguf_cache.is_local(where, gguf):
                return gguf_cache.tokenizer(where, gguf)
            return AutoTokenizer.from_pretrained(where, **kwargs)
    except OSError as e:
        raise DFlashError(
            f"cannot load a tokenizer from {spec!r}: {e}. Pass asset:<name>, a local directory, "
            "a .gguf file or a hub id that exists"
        ) from e


MODEL_DTYPES = ("float32", "bfloat16", "float16")


def load_causal_lm(
    spec: str | Path,
    device: str = "cpu",
    dtype: str = "auto",
    trust_remote_code: bool = False,
) -> Any:
    """An `AutoModelForCausalLM` in eval mode on `device`; GGUF files are dequantised."""
    import torch
    from transformers import AutoModelForCausalLM

    where, gguf = split_spec(spec)
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    elif dtype in MODEL_DTYPES:
        torch_dtype = getattr(torch, dtype)
    else:  # never getattr(torch, <any text>): `--dtype -1` is not torch's attribute to look up
        raise DFlashError(f"--dtype {dtype!r}: give one of {['auto', *MODEL_DTYPES]}")
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "dtype": torch_dtype}
    if gguf is not None:
        kwargs["gguf_file"] = gguf
    check_model_files(where, f"model {spec}")
    from dflash_trainer.formats.safetensors_check import check_model_weights

    check_model_weights(where)
    try:
        with about(f"the model {str(spec)!r}"):
            if gguf is not None and gguf_cache.is_local(where, gguf):
                model: Any = gguf_cache.causal_lm(where, gguf, torch_dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except OSError as e:
        raise DFlashError(f"cannot load a causal LM from {spec!r}: {e}") from e
    return model.to(device).eval()
