"""The speculators (vLLM project) drafter layout: `DrafterSpec` <-> `config.json`.

Schema read from speculators' `DFlashSpeculatorConfig` and converter (v0.7.0 era) and
vLLM's speculators adapter (`update_dflash`):

- the decoder is a nested Qwen3 `transformer_layer_config`;
- `aux_hidden_state_layer_ids` index HF `hidden_states` (0 = embedding output), so
  they are the 0-based decoder-layer ids **plus one**. This is the only place the
  project shifts layer ids; vLLM subtracts the one again for `dflash_config`;
- `speculators_config.proposal_methods[0].speculative_tokens` is what vLLM uses as
  num_speculative_tokens: B-1 (the anchor slot is the bonus token, not a draft);
- newer vLLM copies `layer_types` / `use_sliding_window` / `sliding_window` /
  `max_window_layers` from the top level, older from `transformer_layer_config`:
  both are written, equal.

embed_tokens / lm_head are not written: vLLM then shares the target's, and
speculators' own loader fills them from the verifier.

A DFlash2 drafter is `speculators_model_type: "dflash2"` (speculators'
`DFlash2SpeculatorConfig`, a DFlash config plus the four DFlash2 numbers at the top
level); its weights carry the z-lab DFlash2 tensor names.
"""

from __future__ import annotations

from typing import Any

from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats import dflash2_layout
from dflash_trainer.formats.dflash2_layout import ARCHITECTURE_V2, LOGIT_FIELDS
from dflash_trainer.formats.zlab import geometry_fields, spec_from_geometry

SPECULATORS_VERSION = "0.7.0"
"""The speculators release whose schema this layout follows (informational field)."""

TOP_LEVEL_SLIDING_KEYS = (
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
)

# Tensors a speculators checkpoint may carry that are the target's, not the drafter's.
VERIFIER_TENSORS = frozenset(
    {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
)
VOCAB_MAP_TENSORS = frozenset({"t2d", "d2t"})
MODEL_TYPES = {"dflash": "DFlashDraftModel", "dflash2": ARCHITECTURE_V2}


def speculators_config(
    spec: DrafterSpec,
    dtype: str,
    verifier_name_or_path: str | None,
    verifier_architectures: list[str],
) -> dict[str, Any]:
    layer = geometry_fields(spec)
    layer["dtype"] = dtype
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": spec.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier_name_or_path,
                "architectures": list(verifier_architectures),
            },
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": spec.vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "block_size": spec.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in spec.target_layer_ids],
        "mask_token_id": spec.mask_token_id,
        # Our sliding layers are causal inside the block (docs/algorithm.md section 2).
        "sliding_window_non_causal": False,
        # The anchor slot is the bonus token: B-1 drafts per block.
        "sample_from_anchor": False,
        # Not read by speculators or vLLM: lets `dflash import` rebuild the spec
        # (the target's layer count) without fetching the verifier's config.
        "num_target_layers": spec.num_target_hidden_layers,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    for key in TOP_LEVEL_SLIDING_KEYS:
        cfg[key] = layer[key]
    if spec.is_dflash2:
        cfg["architectures"] = [ARCHITECTURE_V2]
        cfg["speculators_model_type"] = cfg["speculators_config"]["algorithm"] = "dflash2"
        cfg.update(dflash2_layout.export_fields(spec))
        # speculators' DFlash2 default, as the z-lab layout's is_causal=false; it
        # changes nothing here, a DFlash2 export has no sliding layers.
        cfg["sliding_window_non_causal"] = True
    return cfg


def verifier_name(cfg: dict[str, Any]) -> str | None:
    sc = cfg.get("speculators_config")
    if not isinstance(sc, dict) or not isinstance(sc.get("verifier"), dict):
        return None
    name = sc["verifier"].get("name_or_path")
    return str(name) if name else None


def _decoder_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DFlashError(f"{where}: transformer_layer_config must be an object")
    merged = dict(layer)
    for key in TOP_LEVEL_SLIDING_KEYS:
        if key not in cfg:
            continue
        if key in layer and layer[key] != cfg[key]:
            raise DFlashError(
                f"{where}: {key}={cfg[key]!r} at the top level but "
                f"transformer_layer_config.{key}={layer[key]!r}; vLLM versions read "
                "different ones. Make them equal"
            )
        merged[key] = cfg[key]
    if cfg.get("target_hidden_size") is not None:
        merged["target_hidden_size"] = cfg["target_hidden_size"]
    return merged


def spec_from_speculators_config(
    cfg: dict[str, Any], where: str, num_target_layers: int | None
) -> tuple[DrafterSpec, list[str]]:
    """Parse a speculators DFlash config; `num_target_layers` comes from the caller
    when the config lacks our `num_target_layers` field (it then names the target)."""
    warnings: list[str] = []
    kind = cfg.get("speculators_model_type")
    if kind not in MODEL_TYPES:
        raise DFlashError(
            f"{where}: speculators_model_type={kind!r}; only {sorted(MODEL_TYPES)} drafters "
            "can be imported (dspark / eagle3 / mtp are other models)"
        )
    for key in LOGIT_FIELDS:
        if key in cfg and cfg[key] != LOGIT_FIELDS[key]:
            raise DFlashError(dflash2_layout.logit_field_problem(key, cfg[key], where))
    layer = _decoder_fields(cfg, where)
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not aux:
        raise DFlashError(f"{where}: aux_hidden_state_layer_ids is missing or empty")
    if min(int(i) for i in aux) < 1:
        raise DFlashError(
            f"{where}: aux_hidden_state_layer_ids={aux} contains 0 (the embedding output); "
            "this project taps decoder-layer outputs only (speculators id = layer id + 1)"
        )
    mask = cfg.get("mask_token_id")
    if mask is None:
        raise DFlashError(f"{where}: mask_token_id is missing; add the id it was trained with")
    vocab = layer.get("vocab_size")
    draft_vocab = cfg.get("draft_vocab_size", vocab)
    if draft_vocab != vocab:
        raise DFlashError(
            f"{where}: draft_vocab_size={draft_vocab} != vocab_size={vocab}: a reduced "
            "draft vocabulary (t2d/d2t) is not supported; the drafter uses the target's "
            "full lm_head"
        )
    if cfg.get("sample_from_anchor", False):
        raise DFlashError(
            f"{where}: sample_from_anchor=true drafts from the anchor slot too; this "
            "project's drafter treats the anchor as the bonus token"
        )
    block_size = cfg.get("block_size")
    if block_size is None:
        block_size = 8
        warnings.append(f"{where}: no block_size; using speculators' default 8")
    n_target = cfg.get("num_target_layers", num_target_layers)
    if n_target is None:
        raise DFlashError(
            f"{where}: the target's layer count is not in this config; pass the target "
            "(`dflash import PATH --target NAME_OR_PATH`) so it can be read from its config"
        )
    spec = spec_from_geometry(
        layer,
        where,
        block_size=int(block_size),
        mask_token_id=int(mask),
        target_layer_ids=tuple(int(i) - 1 for i in aux),
        num_target_layers=int(n_target),
        warnings=warnings,
    )
    # speculators' DFlash2 config defaults this to true, its DFlash config to false.
    non_causal = cfg.get("sliding_window_non_causal", kind == "dflash2")
    if "sliding_attention" in spec.layer_types and non_causal:
        said = "" if "sliding_window_non_causal" in cfg else " (speculators' DFlash2 default)"
        raise DFlashError(
            f"{where}: sliding_window_non_causal=true{said}: bidirectional sliding layers; "
            "this project's sliding layers are causal inside the block"
        )
    if kind == "dflash2":
        spec = dflash2_layout.with_fields(spec, cfg, where, "")
    tokens = _speculative_tokens(cfg)
    if tokens is not None and tokens != spec.block_size - 1:
        warnings.append(
            f"{where}: speculative_tokens={tokens} but block_size-1={spec.block_size - 1}; "
            "vLLM drafts speculative_tokens per step"
        )
    return spec, warnings


def _speculative_tokens(cfg: dict[str, Any]) -> int | None:
    try:
        return int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
