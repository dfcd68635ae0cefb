"""What `dflash eval` loads: the drafter (this project's files or a published export), the
target it was trained for, the tokenizer, and the identity of each for the report.
"""

from __future__ import annotations

import hashlib
import importlib
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_trainer.config import TargetConfig
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.target.model import FrozenTarget


def check_compatible(spec: DrafterSpec, target: FrozenTarget) -> None:
    """The target must be the one the drafter was trained on (shapes and tapped layers)."""
    cfg = target.model.config.get_text_config()
    have = {
        "hidden_size": int(cfg.hidden_size),
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "vocab_size": int(target.lm_head_weight.shape[0]),
        "tapped layers": list(target.layer_ids),
    }
    want = {
        "hidden_size": spec.target_hidden_size,
        "num_hidden_layers": spec.num_target_hidden_layers,
        "vocab_size": spec.vocab_size,
        "tapped layers": list(spec.target_layer_ids),
    }
    bad = [f"{k}: target {have[k]}, drafter {want[k]}" for k in have if have[k] != want[k]]
    if bad:
        raise DFlashError(
            "the drafter does not fit this target (" + "; ".join(bad) + "); evaluate it with "
            "the target it was trained for (--target), built with the drafter's target_layer_ids"
        )


@dataclass
class EvalModels:
    drafter: nn.Module
    target: FrozenTarget
    tokenizer: Any
    identity: dict[str, Any]
    """What was evaluated: drafter path/format/spec/fingerprint, target source/dtype/shape."""


def split_target(name: str) -> tuple[str, str | None]:
    """`DIR::FILE.gguf` or `path/FILE.gguf` -> (dir, file); anything else -> (name, None)."""
    if "::" in name:
        directory, gguf = name.split("::", 1)
        return directory, gguf
    if name.endswith(".gguf"):
        path = Path(name)
        return str(path.parent), path.name
    return name, None


def read_drafter(path: str) -> tuple[DrafterSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """This project's files (run / checkpoint / drafter dir) or, through `export.import_drafter`
    when that module is installed, a z-lab or speculators export."""
    from dflash_trainer.formats.drafter_io import load_drafter

    try:
        export = importlib.import_module("dflash_trainer.formats.export")
    except ImportError:
        return load_drafter(path)
    result: tuple[DrafterSpec, dict[str, torch.Tensor], dict[str, Any]] = export.import_drafter(
        path
    )
    return result


def _fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the weights (sorted names, raw bytes): which drafter, beyond its path."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _offline_copy(name: str) -> str:
    """A recorded hub id that is not a local path, read from the installed asset that packages
    that model when there is one (said on stderr); otherwise `name` as recorded."""
    from dflash_trainer.assets import installed_asset_for

    if Path(name).exists():
        return name
    asset = installed_asset_for(name)
    if asset is None:
        return name
    print(
        f"dflash eval: the drafter names its target {name}; reading it from the installed "
        f"offline copy {asset} (--target picks another)",
        file=sys.stderr,
    )
    return asset


def _target_config(
    meta: dict[str, Any],
    target: str | None,
    dtype: str | None,
    device: str,
    precision: str = "bf16",
) -> TargetConfig:
    recorded = meta.get("target") or {}
    if target is None:
        if not recorded.get("name_or_path"):
            raise DFlashError(
                "the drafter records no target; pass --target NAME_OR_PATH (hub id, local dir, "
                "asset:<name> or DIR::FILE.gguf)"
            )
        name, gguf = recorded["name_or_path"], recorded.get("gguf_file")
        name = _offline_copy(name)
    else:
        name, gguf = split_target(target)
    if precision == "fp8" and dtype is None:
        dtype = "bfloat16"  # what the FP8 matmuls return
    if dtype is None:
        # bf16 matmuls on CPU are slow and not what a server runs: fp32 there.
        dtype = "float32" if device == "cpu" else recorded.get("dtype") or "bfloat16"
    return TargetConfig(name_or_path=name, gguf_file=gguf, dtype=dtype, precision=precision)  # type: ignore[arg-type]


def load_eval_models(
    drafter_path: str,
    target: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    precision: str = "bf16",
) -> EvalModels:
    """Drafter (eval mode, fp32 weights cast to the target dtype), FrozenTarget, tokenizer.

    precision: the target's matmuls (`fp8`: its linears quantized at load, target/fp8.py)."""
    from dflash_trainer.core.drafter import DFlashDrafter
    from dflash_trainer.data import load_tokenizer
    from dflash_trainer.target.model import load_target_model

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec, state, meta = read_drafter(drafter_path)
    tcfg = _target_config(meta, target, dtype, torch.device(dev).type, precision)
    model = load_target_model(tcfg, dev)
    frozen = FrozenTarget(model, spec.target_layer_ids)
    check_compatible(spec, frozen)
    drafter = DFlashDrafter(spec)
    try:
        drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise DFlashError(f"{drafter_path}: weights do not match the drafter spec ({e})") from e
    drafter = drafter.to(device=dev, dtype=model.dtype).eval()
    tok_spec = f"{tcfg.name_or_path}::{tcfg.gguf_file}" if tcfg.gguf_file else tcfg.name_or_path
    tokenizer = load_tokenizer(tok_spec)
    cfg = model.config.get_text_config()
    identity = {
        "drafter": {
            "path": str(drafter_path),
            "format": (meta.get("source") or {}).get("format", "dflash"),
            "fingerprint": _fingerprint(state),
            "spec": spec.to_dict(),
            "meta": {k: v for k, v in meta.items() if k != "source"},
        },
        "target": {
            "name_or_path": tcfg.name_or_path,
            "gguf_file": tcfg.gguf_file,
            "dtype": tcfg.dtype,
            "precision": tcfg.precision,
            "class": type(model).__name__,
            "num_hidden_layers": int(cfg.num_hidden_layers),
            "hidden_size": int(cfg.hidden_size),
            "vocab_size": int(cfg.vocab_size),
        },
        "environment": _environment(dev),
    }
    return EvalModels(drafter, frozen, tokenizer, identity)


def _environment(device: str) -> dict[str, Any]:
    import transformers

    env = {
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env
