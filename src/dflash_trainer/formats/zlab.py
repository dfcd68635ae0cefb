"""The z-lab / vLLM / SGLang drafter layout: `DrafterSpec` <-> `config.json` fields.

One `config.json` is read by three loaders that default missing fields differently
(docs/algorithm.md section 8): z-lab's reference loader (transformers 4.57 `Qwen3Config`),
vLLM's `qwen3_dflash.py` and SGLang's `dflash.py`. A wrong default loads silently and
accepts nothing, so `zlab_config` writes every field any of them reads, and
`spec_from_zlab_config` reads published configs back, filling a missing field with
the value the z-lab loader would use and saying so in a warning.

The weight names are the project's own state-dict names (they were chosen equal to
z-lab's), so `expected_tensor_shapes` is the whole weight layout of both formats.
A DFlash2 drafter's config differs in the architecture, `is_causal` and four
`dflash_config` numbers (formats/dflash2_layout.py).
"""

from __future__ import annotations

from typing import Any

from dflash_trainer.core.geometry import DrafterSpec, default_target_layer_ids
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats import dflash2_layout
from dflash_trainer.formats.dflash2_layout import ARCHITECTURE_V2, LOGIT_FIELDS

ARCHITECTURE = "DFlashDraftModel"
KINDS = {ARCHITECTURE: "dflash", ARCHITECTURE_V2: "dflash2"}
LAYER_TYPES = ("full_attention", "sliding_attention")

# Defaults of transformers' Qwen3Config, which the z-lab loader inherits for a field
# that config.json leaves out (vLLM differs on rope_theta: it assumes 1e6).
QWEN3_DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "attention_bias": False,
    "max_window_layers": 28,
}

# dflash_config keys that engines read, with the value that means "plain DFlash" (the
# model this project implements). Any other value is a different model: refuse it.
# conv_kernel_size / selector_rank describe DFlash2, whose config names its own
# architecture (they are that model's fields there, not neutral keys).
NEUTRAL_DFLASH_KEYS: dict[str, Any] = {
    "causal": None,
    "use_swa": False,
    "attention_sink_bias": False,
    "use_aux_hidden_state": True,
    "sample_from_anchor": False,
    "conv_kernel_size": 0,
    "selector_rank": 0,
    **LOGIT_FIELDS,
}
DFLASH_KEYS = {"mask_token_id", "target_layer_ids", "block_size", "num_target_layers"}


def max_window_layers(layer_types: tuple[str, ...]) -> int:
    """The `max_window_layers` that reproduces `layer_types` by Qwen3Config's rule.

    That rule (sliding iff i >= max_window_layers) only runs when `layer_types` is
    absent, so every loader here ignores this field; writing the consistent value
    keeps an old loader that drops `layer_types` right whenever that is possible
    (sliding layers form a suffix), else it is the layer count as z-lab publishes.
    """
    n = len(layer_types)
    k = next((i for i, t in enumerate(layer_types) if t == "sliding_attention"), n)
    if all(t == "sliding_attention" for t in layer_types[k:]):
        return k
    return n


def geometry_fields(spec: DrafterSpec) -> dict[str, Any]:
    """The Qwen3-decoder part, shared by the z-lab config and speculators'
    `transformer_layer_config`."""
    sliding = "sliding_attention" in spec.layer_types
    return {
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        # The z-lab loader defaults head_dim to 128, not hidden/heads: always write it.
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "hidden_act": spec.hidden_act,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "attention_bias": spec.attention_bias,
        "attention_dropout": 0.0,
        # Flat for the transformers-4 loader (it reads only this), nested for
        # transformers 5 and vLLM (which default to 10000 / 1e6 without it).
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        # vLLM reads this; rotate-half RoPE is what the drafter was trained with.
        "is_neox_style": True,
        "layer_types": list(spec.layer_types),
        # Qwen3Config drops sliding_window unless use_sliding_window is true.
        "use_sliding_window": sliding,
        "sliding_window": spec.sliding_window if sliding else None,
        "max_window_layers": max_window_layers(spec.layer_types),
        "tie_word_embeddings": False,
    }


def zlab_config(spec: DrafterSpec, dtype: str) -> dict[str, Any]:
    """The full z-lab layout `config.json` for `spec`, weights stored as `dtype`."""
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        # block_size twice: the z-lab loader reads the top level, SGLang the nested
        # one first; both agree by construction.
        "block_size": spec.block_size,
        "num_target_layers": spec.num_target_hidden_layers,
        "dflash_config": {
            "block_size": spec.block_size,
            "mask_token_id": spec.mask_token_id,
            # 0-based decoder-layer ids, NOT shifted: vLLM and SGLang add 1 themselves.
            "target_layer_ids": list(spec.target_layer_ids),
        },
        # vLLM sizes fc from this (z-lab's loader assumes it equals hidden_size).
        "target_hidden_size": spec.target_hidden_size,
    }
    if spec.is_dflash2:
        cfg["architectures"] = [ARCHITECTURE_V2]
        cfg["dflash_config"].update(dflash2_layout.export_fields(spec))
        # The published DFlash2 configs say it; without it the z-lab loader makes
        # sliding layers causal and others may not (a DFlash2 export has none).
        cfg["is_causal"] = False
    cfg.update(geometry_fields(spec))
    # transformers 5 reads `dtype`, 4.x `torch_dtype`; `dtype="auto"` loads need it.
    cfg["dtype"] = dtype
    cfg["torch_dtype"] = dtype
    return cfg


def expected_tensor_shapes(spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the layout and its shape; nothing else may be stored."""
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, spec.num_context_features),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        proj = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
        for name, shape in proj.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if spec.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
        shapes[f"{p}self_attn.q_norm.weight"] = (d,)
        shapes[f"{p}self_attn.k_norm.weight"] = (d,)
        shapes[f"{p}mlp.gate_proj.weight"] = (inter, h)
        shapes[f"{p}mlp.up_proj.weight"] = (inter, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, inter)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    shapes.update(dflash2_layout.tensor_shapes(spec))
    return shapes


# ---------------------------------------------------------------------------- reading


def rope_theta_fields(cfg: dict[str, Any]) -> tuple[float | None, float | None]:
    """(flat rope_theta, rope_parameters.rope_theta), each None when absent."""
    flat = cfg.get("rope_theta")
    rp = cfg.get("rope_parameters")
    nested = rp.get("rope_theta") if isinstance(rp, dict) else None
    return (
        float(flat) if flat is not None else None,
        float(nested) if nested is not None else None,
    )


def _require(cfg: dict[str, Any], key: str, where: str) -> Any:
    if cfg.get(key) is None:
        raise DFlashError(f"{where}: `{key}` is missing; a DFlash drafter config needs it")
    return cfg[key]


def _check_rope_kind(cfg: dict[str, Any], where: str) -> None:
    for key in ("rope_parameters", "rope_scaling"):
        rp = cfg.get(key)
        if not isinstance(rp, dict):
            continue
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind != "default" or float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
            raise DFlashError(
                f"{where}: {key}={rp} is not plain RoPE; this project's drafter uses "
                "default full-dimension RoPE only, so it cannot reproduce this model"
            )
    if cfg.get("is_neox_style", cfg.get("rope_is_neox_style", True)) is not True:
        raise DFlashError(
            f"{where}: is_neox_style is false (interleaved RoPE); the drafter uses "
            "rotate-half RoPE and would compute different keys and queries"
        )


def _rope_theta(cfg: dict[str, Any], where: str, warnings: list[str]) -> float:
    flat, nested = rope_theta_fields(cfg)
    if flat is not None and nested is not None and flat != nested:
        raise DFlashError(
            f"{where}: rope_theta={flat} but rope_parameters.rope_theta={nested}; the "
            "transformers-4 loader reads the flat value, transformers 5 and vLLM the "
            "nested one. Set both to the value the drafter was trained with"
        )
    theta = nested if nested is not None else flat
    if theta is None:
        warnings.append(
            f"{where}: no rope_theta (flat or in rope_parameters); using 10000 as the "
            "z-lab loader does (vLLM would assume 1e6: the engines disagree)"
        )
        return float(QWEN3_DEFAULTS["rope_theta"])
    return theta


def _layer_types(
    cfg: dict[str, Any], n_layers: int, where: str, warnings: list[str]
) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) as the drafter was trained, with the window
    taken as written even where use_sliding_window=false would make an old loader
    drop it (said in a warning)."""
    window = cfg.get("sliding_window")
    use_window = bool(cfg.get("use_sliding_window", False))
    lt = cfg.get("layer_types")
    if lt is None:
        mwl = int(cfg.get("max_window_layers", QWEN3_DEFAULTS["max_window_layers"]))
        on = use_window and window is not None
        lt = ["sliding_attention" if on and i >= mwl else "full_attention" for i in range(n_layers)]
        warnings.append(
            f"{where}: no layer_types; derived {lt} from use_sliding_window/"
            "max_window_layers as Qwen3Config does"
        )
    types = tuple(str(t) for t in lt)
    if len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise DFlashError(
            f"{where}: layer_types={list(types)} must list {n_layers} entries "
            f"(num_hidden_layers), each one of {list(LAYER_TYPES)}"
        )
    if "sliding_attention" not in types:
        return types, None
    if window is None or int(window) <= 0:
        raise DFlashError(
            f"{where}: layer_types has sliding_attention layers but sliding_window="
            f"{window}; give the window the drafter was trained with"
        )
    if not use_window:
        warnings.append(
            f"{where}: sliding layers with use_sliding_window=false: transformers' "
            "Qwen3Config (the z-lab loader) drops the window and runs those layers as "
            f"full attention; importing with the written window {window}"
        )
    return types, int(window)


def _check_dflash_extras(dflash: dict[str, Any], where: str, kind: str) -> None:
    for key, value in dflash.items():
        if key in DFLASH_KEYS or (kind == "dflash2" and key in dflash2_layout.FIELDS):
            continue
        if key in NEUTRAL_DFLASH_KEYS and value == NEUTRAL_DFLASH_KEYS[key]:
            continue
        if key in LOGIT_FIELDS:
            raise DFlashError(dflash2_layout.logit_field_problem(key, value, where))
        if key in dflash2_layout.FIELDS:
            raise DFlashError(
                f"{where}: dflash_config.{key} is a DFlash2 field but architectures says "
                f'{ARCHITECTURE}; a DFlash2 drafter says ["{ARCHITECTURE_V2}"]'
            )
        raise DFlashError(
            f"{where}: dflash_config.{key}={value!r} describes a DFlash variant this "
            "project does not implement (plain DFlash: context K/V in every layer, "
            "bidirectional full layers, causal sliding layers, anchor as bonus token)"
        )


def spec_from_geometry(
    cfg: dict[str, Any],
    where: str,
    *,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: tuple[int, ...],
    num_target_layers: int,
    warnings: list[str],
) -> DrafterSpec:
    """A DrafterSpec from Qwen3-decoder fields plus the DFlash numbers read elsewhere."""
    _check_rope_kind(cfg, where)
    hidden = int(_require(cfg, "hidden_size", where))
    n_layers = int(_require(cfg, "num_hidden_layers", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is None:
        warnings.append(f"{where}: no num_key_value_heads; using num_attention_heads={heads}")
        kv_heads = heads
    filled: dict[str, Any] = {}
    for key in ("head_dim", "rms_norm_eps", "hidden_act", "max_position_embeddings"):
        filled[key] = cfg.get(key)
        if filled[key] is None:
            filled[key] = QWEN3_DEFAULTS[key]
            warnings.append(
                f"{where}: no {key}; using {filled[key]!r} as the z-lab loader does "
                "(Qwen3Config's default)"
            )
    if filled["hidden_act"] != "silu":
        raise DFlashError(
            f"{where}: hidden_act={filled['hidden_act']!r}; the drafter's MLP is SwiGLU "
            "(silu), as in z-lab's, vLLM's and SGLang's DFlash models"
        )
    layer_types, window = _layer_types(cfg, n_layers, where, warnings)
    if any(not 0 <= i < num_target_layers for i in target_layer_ids):
        raise DFlashError(
            f"{where}: target_layer_ids={list(target_layer_ids)} out of range for "
            f"num_target_layers={num_target_layers} (0-based decoder-layer ids)"
        )
    return DrafterSpec(
        hidden_size=hidden,
        vocab_size=int(_require(cfg, "vocab_size", where)),
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        num_target_hidden_layers=int(num_target_layers),
        target_layer_ids=tuple(int(i) for i in target_layer_ids),
        block_size=int(block_size),
        mask_token_id=int(mask_token_id),
        num_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(filled["head_dim"]),
        intermediate_size=int(_require(cfg, "intermediate_size", where)),
        rope_theta=_rope_theta(cfg, where, warnings),
        layer_types=layer_types,
        sliding_window=window,
        rms_norm_eps=float(filled["rms_norm_eps"]),
        max_position_embeddings=int(filled["max_position_embeddings"]),
        hidden_act=str(filled["hidden_act"]),
        attention_bias=bool(cfg.get("attention_bias", False)),
    )


def _one_of(cfg: dict[str, Any], dflash: dict[str, Any], key: str, where: str) -> Any:
    """A field that may sit at the top level or inside dflash_config (never disagreeing)."""
    top, nested = cfg.get(key), dflash.get(key)
    if top is not None and nested is not None and top != nested:
        raise DFlashError(
            f"{where}: {key}={top} at the top level but dflash_config.{key}={nested}; "
            "loaders read different ones. Make them equal"
        )
    return nested if nested is not None else top


def architecture_kind(cfg: dict[str, Any], where: str, warnings: list[str]) -> str:
    """'dflash' or 'dflash2' from `architectures` (the field engines select the model by);
    anything else is another model and refused."""
    archs = cfg.get("architectures")
    if not archs:
        warnings.append(
            f"{where}: no architectures; reading it as {ARCHITECTURE} (engines select the "
            "model by this field: write it)"
        )
        return "dflash"
    if not isinstance(archs, list):
        raise DFlashError(f"{where}: architectures={archs!r} must be a list of names")
    kinds = {KINDS.get(a) if isinstance(a, str) else None for a in archs}
    if None in kinds or len(kinds) != 1:
        raise DFlashError(
            f"{where}: architectures={archs}: this project imports exactly one of "
            f"{list(KINDS)} (DFlash, DFlash2); anything else is another model that it "
            "would run wrong"
        )
    return str(kinds.pop())


def _check_is_causal(cfg: dict[str, Any], kind: str, sliding: bool, where: str) -> None:
    """`is_causal` as the z-lab loader reads it: true makes every layer causal; false
    makes sliding layers bidirectional inside the block. Ours: full layers
    bidirectional, sliding layers causal."""
    value = cfg.get("is_causal")
    if value is None and not (kind == "dflash2" and sliding):
        return
    if value is True:
        raise DFlashError(
            f"{where}: is_causal=true makes every layer causal inside the block; this "
            "project's full_attention layers are bidirectional there, so it would run "
            "this drafter wrong"
        )
    if sliding:
        engines = (
            "engines run them bidirectionally inside the block"
            if value is False
            else "DFlash2 engines run them bidirectionally inside the block (the published "
            "is_causal=false) or causal, depending on the engine"
        )
        raise DFlashError(
            f"{where}: sliding_attention layers with is_causal={value!r}: {engines}, while "
            "this project runs them causal there, so it would run this drafter wrong "
            "(a DFlash2 drafter it can import has full_attention layers only)"
        )
    if value is not False:
        raise DFlashError(f"{where}: is_causal={value!r} must be false or absent")


def spec_from_zlab_config(cfg: dict[str, Any], where: str) -> tuple[DrafterSpec, list[str]]:
    """Parse a z-lab layout config.json; warnings name every default that was filled."""
    warnings: list[str] = []
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        raise DFlashError(
            f"{where}: no dflash_config object; not a z-lab DFlash drafter config "
            "(the z-lab loader fails without it)"
        )
    kind = architecture_kind(cfg, where, warnings)
    _check_dflash_extras(dflash, where, kind)
    for key in LOGIT_FIELDS:  # the z-lab loader also reads them at the top level
        if key in cfg and cfg[key] != LOGIT_FIELDS[key]:
            raise DFlashError(dflash2_layout.logit_field_problem(key, cfg[key], where))
    if cfg.get("model_type", "qwen3") != "qwen3":
        warnings.append(
            f"{where}: model_type={cfg.get('model_type')!r}; reading it as the Qwen3-style "
            "DFlash decoder (the tensor names are checked next)"
        )
    block_size = _one_of(cfg, dflash, "block_size", where)
    if block_size is None:
        raise DFlashError(
            f"{where}: no block_size (neither top-level nor in dflash_config); the z-lab "
            "loader needs it. Add the block size the drafter was trained with"
        )
    n_target = _one_of(cfg, dflash, "num_target_layers", where)
    if n_target is None:
        raise DFlashError(
            f"{where}: no num_target_layers; add the target's total decoder-layer count "
            "(the z-lab loader needs it)"
        )
    mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise DFlashError(
            f"{where}: no dflash_config.mask_token_id; add the mask token id the drafter "
            "was trained with (SGLang would otherwise look up a '<|MASK|>' token)"
        )
    ids = dflash.get("target_layer_ids")
    if ids is None:
        ids = default_target_layer_ids(
            int(n_target), int(_require(cfg, "num_hidden_layers", where))
        )
        warnings.append(
            f"{where}: no dflash_config.target_layer_ids; using z-lab's default spread "
            f"{list(ids)} (one tapped layer per drafter layer)"
        )
    spec = spec_from_geometry(
        cfg,
        where,
        block_size=int(block_size),
        mask_token_id=int(mask),
        target_layer_ids=tuple(int(i) for i in ids),
        num_target_layers=int(n_target),
        warnings=warnings,
    )
    _check_is_causal(cfg, kind, "sliding_attention" in spec.layer_types, where)
    if kind == "dflash2":
        spec = dflash2_layout.with_fields(spec, dflash, where, "dflash_config.")
    return spec, warnings
