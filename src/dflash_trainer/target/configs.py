"""The target's HF config without its weights: local, bundled, or from the hub.

`plan` and `doctor` must answer on a laptop with no network, so the published configs
of the recipes' targets are bundled here (public facts, ASSETS.md). A local directory
or the hub always wins when given explicitly: the bundled entry is used only for an
exact hub id that is not a local path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_trainer.assets import resolve_source
from dflash_trainer.config import TargetConfig
from dflash_trainer.errors import DFlashError

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


def load_target_config(tcfg: TargetConfig) -> Any:
    """The target's (text) HF config, with `hf_config_overrides` applied; no weights loaded."""
    from transformers import AutoConfig

    name, gguf = target_source(tcfg)
    if name in KNOWN_CONFIGS and not Path(name).exists():
        cfg = config_from_dict(KNOWN_CONFIGS[name])
    else:
        try:
            kw: dict[str, Any] = {"trust_remote_code": tcfg.trust_remote_code}
            if gguf:
                kw["gguf_file"] = gguf
            if tcfg.revision:
                kw["revision"] = tcfg.revision
            cfg = AutoConfig.from_pretrained(name, **kw)
        except (OSError, ValueError) as e:
            raise DFlashError(
                f"target.name_or_path={tcfg.name_or_path!r}: cannot read its config ({e}). "
                "Give a local model directory, a GGUF asset (asset:smollm2-135m-instruct), "
                f"or one of the bundled hub ids {sorted(KNOWN_CONFIGS)}"
            ) from e
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for key, value in tcfg.hf_config_overrides.items():
        if not hasattr(text, key):
            raise DFlashError(
                f"target.hf_config_overrides.{key}: the target config "
                f"({type(text).__name__}) has no field {key!r}"
            )
        setattr(text, key, value)
    if "num_hidden_layers" in tcfg.hf_config_overrides and hasattr(text, "layer_types"):
        lt = getattr(text, "layer_types", None)
        if lt is not None and len(lt) != text.num_hidden_layers:
            text.layer_types = list(lt)[: text.num_hidden_layers]
    return text
