"""The target's HF config without its weights: local, bundled, or from the hub.

`plan` and `doctor` must answer on a laptop with no network, so the published configs
of the recipes' targets are bundled here (public facts, docs/assets.md). A local directory
or the hub always wins when given explicitly: the bundled entry is used only for an
exact hub id that is not a local path.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_trainer import gguf_cache
from dflash_trainer.assets import resolve_source
from dflash_trainer.config import TargetConfig
from dflash_trainer.errors import DFlashError, about
from dflash_trainer.model_dir_check import check_model_files, size_limit

_QWEN36_LAYER_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 16

KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    # The GGUF asset's own config (asset:smollm2-135m-instruct): with random_init it gives
    # a same-shaped target on a machine without the asset (timing runs, plan, doctor).
    "HuggingFaceTB/SmolLM2-135M-Instruct": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    },
    "Qwen/Qwen3-8B": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "eos_token_id": 151645,
        "bos_token_id": 151643,
    },
    "Qwen/Qwen3.6-27B": {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "layer_types": _QWEN36_LAYER_TYPES,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "attn_output_gate": True,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 248320,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "eos_token_id": 248044,
    },
}


def config_from_dict(d: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    d = dict(d)
    model_type = d.pop("model_type")
    return AutoConfig.for_model(model_type, **d)


def target_source(tcfg: TargetConfig) -> tuple[str, str | None]:
    """(directory or hub id, GGUF file name or None): assets resolved, a .gguf path split."""
    src = resolve_source(tcfg.name_or_path)
    if isinstance(src, Path) and src.suffix == ".gguf":
        return str(src.parent), src.name
    return str(src), tcfg.gguf_file


# ---------------------------------------------------------------- remote code

# Set only by the command line's --trust-remote-code (cli.main) or by a caller that
# enters `remote_code_granted()` itself: `target.trust_remote_code: true` in a config
# file, say the config.yaml of a run directory someone sent, is a request, not a grant.
_GRANTED = False
_ANNOUNCED: set[str] = set()


@contextlib.contextmanager
def remote_code_granted(granted: bool = True) -> Iterator[None]:
    global _GRANTED
    before, _GRANTED = _GRANTED, granted
    try:
        yield
    finally:
        _GRANTED = before


def remote_code_files(name: str) -> str:
    """What would run: the .py files of a local model directory, or the hub repo's code."""
    p = Path(name)
    if p.is_dir():
        files = sorted(str(f.relative_to(p)) for f in p.rglob("*.py"))
        return f"{p}: {', '.join(files) if files else 'no .py files'}"
    return f"the Python files of the hub repository {name!r}"


def allow_remote_code(tcfg: TargetConfig) -> bool:
    """The trust_remote_code value to pass to transformers for this target.

    False unless the config asks for it; when it does, refused without the command-line
    grant, and announced (what will run) before anything is loaded with it.
    """
    if not tcfg.trust_remote_code:
        return False
    name, _ = target_source(tcfg)
    if not _GRANTED:
        raise DFlashError(
            f"target.trust_remote_code is true for {tcfg.name_or_path!r}: that would run "
            f"{remote_code_files(name)}. A config file cannot allow that on its own; pass "
            "--trust-remote-code on the command line if you trust this code, or set "
            "target.trust_remote_code=false"
        )
    if name not in _ANNOUNCED:
        _ANNOUNCED.add(name)
        rev = f" at revision {tcfg.revision}" if tcfg.revision else ""
        print(f"--trust-remote-code: running {remote_code_files(name)}{rev}", file=sys.stderr)
    return True


# ---------------------------------------------------------------- config


def load_target_config(tcfg: TargetConfig) -> Any:
    """The target's (text) HF config, with `hf_config_overrides` applied; no weights loaded."""
    from transformers import AutoConfig, PretrainedConfig

    trust = allow_remote_code(tcfg)
    name, gguf = target_source(tcfg)
    if name in KNOWN_CONFIGS and not Path(name).exists():
        cfg = config_from_dict(KNOWN_CONFIGS[name])
    else:
        try:
            kw: dict[str, Any] = {"trust_remote_code": trust}
            if gguf:
                kw["gguf_file"] = gguf
            if tcfg.revision:
                kw["revision"] = tcfg.revision
            check_model_files(name, "target.name_or_path")
            with about(f"the config of target.name_or_path={tcfg.name_or_path!r}"):
                if gguf and gguf_cache.is_local(name, gguf):
                    cfg = gguf_cache.config(name, gguf)
                else:
                    cfg = AutoConfig.from_pretrained(name, **kw)
        except (OSError, ValueError) as e:
            raise DFlashError(
                f"target.name_or_path={tcfg.name_or_path!r}: cannot read its config ({e}). "
                "Give a local model directory, a GGUF asset (asset:smollm2-135m-instruct), "
                f"or one of the bundled hub ids {sorted(KNOWN_CONFIGS)}"
            ) from e
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if not isinstance(text, PretrainedConfig):  # a config.json whose text_config is not a map
        raise DFlashError(
            f"target.name_or_path={tcfg.name_or_path!r}: its config's text part is "
            f"{type(text).__name__} {text!r:.60}, not a model config; the config.json is "
            "damaged: fix or replace it"
        )
    apply_hf_overrides(text, tcfg.hf_config_overrides)
    return text


_IDENTITY = ("model_type", "architectures", "auto_map", "text_config", "sub_configs")


def _is_size(key: str) -> bool:
    """An integer HF config field that counts or sizes something (so at least 1)."""
    return key.startswith("num_") or key.endswith(("_size", "_dim", "max_position_embeddings"))


def check_hf_override(text: Any, key: str, value: Any) -> Any:
    """One override against the target's config class: the field exists and the value
    has the type (and, for sizes and counts, the sign) of what it replaces. Returns the
    value to set (YAML 1.1 reads `1e-6` as a string: a float field takes it as a number)."""
    where = f"target.hf_config_overrides.{key}"
    cls = type(text).__name__
    if key in _IDENTITY:  # the class is chosen from these before any override applies
        raise DFlashError(
            f"{where}: names which model this is, not a setting of it; give that model's "
            "directory or hub id as target.name_or_path instead"
        )
    fields = sorted(text.to_dict()) if hasattr(text, "to_dict") else []
    if key not in fields and (not hasattr(text, key) or callable(getattr(text, key))):
        near = difflib.get_close_matches(key, fields, n=5, cutoff=0.5)
        hint = f"; fields with a similar name: {near}" if near else ""
        raise DFlashError(
            f"{where}: the target config ({cls}) has no field {key!r}{hint}; an override "
            "sets a field the target's config.json already has"
        )
    current = getattr(text, key)
    if current is None or value is None:
        return value
    if isinstance(current, float) and isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(current, bool):
        ok = isinstance(value, bool)
    elif isinstance(current, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(current, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    elif isinstance(current, str | list | dict):
        ok = isinstance(value, type(current))
    else:
        ok = True
    if not ok:
        raise DFlashError(
            f"{where}: {cls}.{key} is {type(current).__name__} ({current!r}); got {value!r}"
        )
    if isinstance(current, int) and not isinstance(current, bool) and _is_size(key) and value < 1:
        raise DFlashError(
            f"{where}: {cls}.{key} counts or sizes something; must be >= 1, got {value}"
        )
    limit = size_limit(key)
    if isinstance(value, int) and limit is not None and value > limit:
        raise DFlashError(f"{where}: {cls}.{key} is {value:,}; no model has more than {limit:,}")
    return value


def apply_hf_overrides(text: Any, overrides: dict[str, Any]) -> None:
    """Check every override against the config class, then set them (and shorten
    layer_types to a smaller num_hidden_layers)."""
    checked = {key: check_hf_override(text, key, value) for key, value in overrides.items()}
    for key, value in checked.items():
        setattr(text, key, value)
    if "num_hidden_layers" in overrides and hasattr(text, "layer_types"):
        lt = getattr(text, "layer_types", None)
        if lt is not None and len(lt) != text.num_hidden_layers:
            text.layer_types = list(lt)[: text.num_hidden_layers]


def check_shape_overrides(model: Any, text: Any, overrides: dict[str, Any]) -> None:
    """Overrides of a model loaded from its weights: a size or count that differs from the
    model as built (from its own config.json) would make the config lie about the weights it
    describes; the drafter built from it then fails on the first matmul. Such overrides are
    for target.random_init, where the model is built from them."""
    built = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    built = built if built is not None else model.config
    for key in overrides:
        if not _is_size(key) or key == "max_position_embeddings":
            continue
        have, want = getattr(built, key, None), getattr(text, key, None)
        if have is not None and have != want:
            raise DFlashError(
                f"target.hf_config_overrides.{key}: {want!r}, but the weights loaded from "
                f"target.name_or_path have {have!r}; a size of a loaded model is its weights' "
                "(set target.random_init: true to build a model of that size instead)"
            )
