"""The speculators half of the config checks of `dflash export --check`.

Besides the decoder fields (nested in `transformer_layer_config`), a speculators config
names its model type and algorithm, the drafted tokens per step, the verifier, the
tapped layers as hidden_states indices, and the flags vLLM reads for the anchor and the
sliding layers; `ConfigView` carries the numbers to the shared geometry checks.
"""

from __future__ import annotations

from typing import Any

from dflash_trainer.formats.check_config import CheckReport, ConfigView, is_int
from dflash_trainer.formats.dflash2_layout import FIELDS as DFLASH2_FIELDS
from dflash_trainer.formats.speculators import MODEL_TYPES, TOP_LEVEL_SLIDING_KEYS


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def check_speculators_config(cfg: dict[str, Any], r: CheckReport) -> ConfigView:
    layer = _check_speculators_kind(cfg, r)
    block = cfg.get("block_size")
    _check_speculators_proposal(cfg, block, r)
    ids = _aux_layer_ids(cfg.get("aux_hidden_state_layer_ids"), r)
    _check_speculators_flags(cfg, layer, r)
    mask = cfg.get("mask_token_id")
    if mask is None:
        r.error("mask_token_id", "missing", "write the trained mask token id")
    kind = "dflash2" if cfg.get("speculators_model_type") == "dflash2" else "dflash"
    return ConfigView(
        layer,
        block,
        mask,
        ids,
        cfg.get("num_target_layers"),
        cfg.get("target_hidden_size", layer.get("hidden_size")),
        kind,
        {k: cfg.get(k) for k in DFLASH2_FIELDS} if kind == "dflash2" else {},
        "",
    )


def _check_speculators_kind(cfg: dict[str, Any], r: CheckReport) -> dict[str, Any]:
    """The model types; returns the decoder config (empty when missing)."""
    model_type = cfg.get("speculators_model_type")
    if model_type not in MODEL_TYPES:
        r.error("speculators_model_type", f"is {model_type!r}", 'write "dflash" or "dflash2"')
    elif cfg.get("architectures") != [MODEL_TYPES[model_type]]:
        r.error(
            "architectures",
            f"is {cfg.get('architectures')!r} with speculators_model_type {model_type!r}",
            f'write ["{MODEL_TYPES[model_type]}"]',
        )
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        r.error(
            "transformer_layer_config",
            "missing or not an object",
            "write the Qwen3 decoder config there",
        )
        layer = {}
    if layer.get("model_type") != "qwen3":
        r.error(
            "transformer_layer_config.model_type",
            f"is {layer.get('model_type')!r}",
            'write "qwen3"',
        )
    return layer


def _check_speculators_proposal(cfg: dict[str, Any], block: Any, r: CheckReport) -> None:
    """Algorithm, drafted tokens per step (= block_size - 1) and the verifier."""
    sc = _obj(cfg.get("speculators_config"))
    methods = sc.get("proposal_methods")
    first = methods[0] if isinstance(methods, list) and methods else {}
    tokens = first.get("speculative_tokens") if isinstance(first, dict) else None
    algorithm = cfg.get("speculators_model_type")
    algorithm = algorithm if algorithm in MODEL_TYPES else "dflash"
    if sc.get("algorithm") != algorithm:
        r.error(
            "speculators_config.algorithm", f"is {sc.get('algorithm')!r}", f'write "{algorithm}"'
        )
    if block is None:
        r.error("block_size", "missing: speculators assumes 8", "write the trained block size")
    elif not is_int(block) or tokens != block - 1:
        fix = f"write block_size - 1 = {block - 1}" if is_int(block) else "write block_size - 1"
        r.error(
            "speculators_config.proposal_methods[0].speculative_tokens",
            f"is {tokens!r}; vLLM drafts this many tokens per step",
            fix,
        )
    verifier = _obj(sc.get("verifier"))
    if not verifier.get("name_or_path"):
        r.warn(
            "speculators_config.verifier.name_or_path",
            "empty: `vllm serve DIR` cannot find the target",
            "re-export with --target, or serve with the long form",
        )


def _aux_layer_ids(aux: Any, r: CheckReport) -> list[int] | None:
    """hidden_states indices (layer id + 1) -> 0-based layer ids, or None when unusable."""
    if not aux:
        r.error("aux_hidden_state_layer_ids", "missing", "write the tapped layer ids + 1")
        return None
    if not isinstance(aux, list) or not all(is_int(i) for i in aux):
        r.error("aux_hidden_state_layer_ids", f"is {aux!r}", "write a list of integers")
        return None
    if min(aux) < 1:
        r.error(
            "aux_hidden_state_layer_ids",
            f"{aux} has 0 (embedding output)",
            "ids are hidden_states indices: 0-based layer id + 1",
        )
        return None
    return [int(i) - 1 for i in aux]


def _check_speculators_flags(cfg: dict[str, Any], layer: dict[str, Any], r: CheckReport) -> None:
    """Full vocabulary, the anchor as bonus token, causal sliding layers, one window."""
    if cfg.get("draft_vocab_size") != layer.get("vocab_size"):
        r.error(
            "draft_vocab_size",
            f"{cfg.get('draft_vocab_size')} != vocab_size {layer.get('vocab_size')}",
            "write the full vocab size (no t2d/d2t)",
        )
    flags = [("sample_from_anchor", "write false: the anchor slot is the bonus token")]
    if cfg.get("speculators_model_type") != "dflash2":  # DFlash2: check_dflash2.py
        flags.append(
            ("sliding_window_non_causal", "write false: sliding layers are causal inside the block")
        )
    for key, why in flags:
        if cfg.get(key) is not False:
            r.error(key, f"is {cfg.get(key)!r}", why)
    for key in TOP_LEVEL_SLIDING_KEYS:
        if key in cfg and cfg[key] != layer.get(key):
            r.error(
                key,
                f"top level {cfg[key]!r} != transformer_layer_config {layer.get(key)!r}",
                "make them equal (vLLM versions read different ones)",
            )
