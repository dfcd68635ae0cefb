"""The config half of `dflash export --check`: every layout field, without defaults.

Engines load a slightly wrong drafter silently and then accept nothing, so this is
strict where the importer is lenient: a field that some loader would default is an
error here, reported with what breaks and the fix. `ConfigView` holds the DFlash
numbers of either layout so the geometry and target checks are written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dflash_trainer.formats.dflash2_layout import FIELDS as DFLASH2_FIELDS
from dflash_trainer.formats.dflash2_layout import LOGIT_FIELDS
from dflash_trainer.formats.zlab import (
    KINDS,
    LAYER_TYPES,
    NEUTRAL_DFLASH_KEYS,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Field -> what goes wrong when it is missing (docs/algorithm.md section 8).
REQUIRED_GEOMETRY: dict[str, str] = {
    "hidden_size": "loaders fall back to Qwen3Config's 4096 and the weights do not fit",
    "intermediate_size": "loaders fall back to Qwen3Config's 22016",
    "num_hidden_layers": "loaders fall back to 32 drafter layers",
    "num_attention_heads": "loaders fall back to 32 heads",
    "num_key_value_heads": "loaders fall back to num_attention_heads (no GQA)",
    "vocab_size": "loaders fall back to 151936",
    "head_dim": "the z-lab loader uses 128, not hidden_size / num_attention_heads",
    "rms_norm_eps": "silently defaulted to 1e-6",
    "hidden_act": "silently defaulted to silu",
    "max_position_embeddings": "silently defaulted to 32768 (RoPE cache size in vLLM)",
    "attention_bias": "silently defaulted to false",
    "layer_types": "derived from use_sliding_window / max_window_layers instead",
    "rope_theta": "the transformers-4 z-lab loader reads only the flat value, else 10000",
    "rope_parameters": "transformers 5 and vLLM read this; vLLM assumes rope_theta 1e6 without it",
}


@dataclass(frozen=True)
class Problem:
    severity: Literal["error", "warning"]
    field: str
    message: str
    fix: str


@dataclass
class CheckReport:
    path: Path
    fmt: str | None = None
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def error(self, fld: str, message: str, fix: str) -> None:
        self.problems.append(Problem("error", fld, message, fix))

    def warn(self, fld: str, message: str, fix: str) -> None:
        self.problems.append(Problem("warning", fld, message, fix))

    def render(self) -> str:
        lines = [f"checking {self.path} ({self.fmt or 'unknown'} layout)"]
        for p in self.problems:
            tag = "FAIL" if p.severity == "error" else "WARN"
            lines.append(f"  {tag}  {p.field}: {p.message}")
            lines.append(f"        fix: {p.fix}")
        lines += [f"  note: {n}" for n in self.notes]
        errors = sum(p.severity == "error" for p in self.problems)
        warnings = len(self.problems) - errors
        verdict = "OK" if errors == 0 else "FAILED"
        lines.append(f"result: {verdict} ({errors} errors, {warnings} warnings)")
        return "\n".join(lines)


@dataclass
class ConfigView:
    """The DFlash numbers of either layout, read without defaults."""

    geometry: dict[str, Any]
    block_size: Any
    mask_token_id: Any
    layer_ids: Any
    num_target_layers: Any
    target_hidden_size: Any
    kind: str = "dflash"
    """dflash | dflash2, as the architecture (z-lab) or model type (speculators) says."""
    dflash2: dict[str, Any] = field(default_factory=dict)
    """The four DFlash2 numbers as written (DFlash2 configs only)."""
    dflash2_place: str = ""
    """Where they live: 'dflash_config.' (z-lab) or '' (speculators: the top level)."""


# ------------------------------------------------------------------------ config


def _check_dflash_keys(dflash: dict[str, Any], kind: str | None, r: CheckReport) -> None:
    """dflash_config keys that describe another model than the architecture says."""
    for key, value in dflash.items():
        neutral = NEUTRAL_DFLASH_KEYS.get(key, value)
        if key in DFLASH2_FIELDS and kind == "dflash2":
            continue
        if key in DFLASH2_FIELDS and kind == "dflash":
            r.error(
                f"dflash_config.{key}",
                "a DFlash2 field in a DFlashDraftModel config",
                'write architectures ["DFlash2DraftModel"] (a DFlash2 drafter) or remove it',
            )
            continue
        if key in LOGIT_FIELDS and value != neutral:
            r.error(
                f"dflash_config.{key}",
                f"={value!r} scales the target's logits or embeddings; this project's "
                "drafters are trained and served without it",
                f"remove it (no transform is {key}={neutral!r})",
            )
        elif key in NEUTRAL_DFLASH_KEYS and value != neutral:
            r.error(
                f"dflash_config.{key}",
                f"={value!r} changes the model engines run",
                f"remove it (plain DFlash is {key}={neutral!r})",
            )


def check_zlab_config(cfg: dict[str, Any], r: CheckReport) -> ConfigView:
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    kind = KINDS.get(arch) if isinstance(arch, str) else None
    if kind is None:
        r.error(
            "architectures",
            f"is {archs!r}",
            " or ".join(f'write ["{a}"]' for a in KINDS) + " (DFlash, DFlash2)",
        )
    if cfg.get("model_type") != "qwen3":
        r.error("model_type", f"is {cfg.get('model_type')!r}", 'write "qwen3"')
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        r.error(
            "dflash_config",
            "missing: the z-lab loader fails without it",
            "write {mask_token_id, target_layer_ids}",
        )
        dflash = {}
    for key in ("mask_token_id", "target_layer_ids"):
        if dflash.get(key) is None:
            r.error(f"dflash_config.{key}", "missing", f"write dflash_config.{key}")
    _check_dflash_keys(dflash, kind, r)
    top, nested = cfg.get("block_size"), dflash.get("block_size")
    if top is None and not (kind == "dflash2" and nested is not None):
        # (DFlash2 loaders read the nested one: the published configs have only that.)
        r.error(
            "block_size",
            "missing at the top level: the z-lab loader reads config.block_size",
            "write block_size at the top level (and in dflash_config)",
        )
    elif top is not None and nested is not None and top != nested:
        r.error(
            "block_size",
            f"top level {top} != dflash_config {nested}: SGLang reads the nested one",
            "make them equal",
        )
    if cfg.get("num_target_layers") is None:
        r.error(
            "num_target_layers",
            "missing: the z-lab loader fails without it",
            "write the target's decoder-layer count",
        )
    hidden = cfg.get("hidden_size")
    t_hidden = cfg.get("target_hidden_size", hidden)
    if t_hidden != hidden:
        r.error(
            "target_hidden_size",
            f"{t_hidden} != hidden_size {hidden}: z-lab's and "
            "SGLang's loaders size fc as n_layers * hidden_size",
            "only vLLM reads target_hidden_size; use the speculators layout or a drafter "
            "whose hidden_size equals the target's",
        )
    return ConfigView(
        cfg,
        cfg.get("block_size", dflash.get("block_size")),
        dflash.get("mask_token_id"),
        dflash.get("target_layer_ids"),
        cfg.get("num_target_layers"),
        t_hidden,
        kind or "dflash",
        {k: dflash.get(k) for k in DFLASH2_FIELDS} if kind == "dflash2" else {},
        "dflash_config.",
    )


# ------------------------------------------------------------------------ numbers

# Numeric fields of a drafter config: (kind, lowest, highest). The bounds are what a
# drafter that works can hold; the upper ones are sanity limits against a corrupt or
# hostile config (an import would otherwise allocate whatever it says).
NUMBERS: dict[str, tuple[str, float, float]] = {
    "hidden_size": ("int", 1, 2**16),
    "intermediate_size": ("int", 1, 2**18),
    "num_hidden_layers": ("int", 1, 64),
    "num_attention_heads": ("int", 1, 1024),
    "num_key_value_heads": ("int", 1, 1024),
    "head_dim": ("int", 2, 1024),
    "vocab_size": ("int", 1, 2**24),
    "max_position_embeddings": ("int", 1, 2**24),
    "sliding_window": ("int", 1, 2**24),
    "rms_norm_eps": ("float", 1e-12, 0.5),
    "rope_theta": ("float", 1.0, 1e12),
}


def is_int(x: Any) -> bool:
    """An integer that is not a bool (JSON true would otherwise pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _bad_number(value: Any, kind: str, lo: float, hi: float) -> str | None:
    """Why `value` cannot be this field, or None. NaN fails `lo <= x <= hi`."""
    if kind == "int" and not is_int(value):
        return f"is {value!r}, not an integer"
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, int | float)):
        return f"is {value!r}, not a number"
    if not lo <= value <= hi:
        return f"is {value!r}, outside [{lo:g}, {hi:g}]"
    return None


def check_numbers(v: ConfigView, r: CheckReport) -> None:
    """Types and ranges of every number the drafter is built from; a missing field is
    left to the layout checks (the importer fills defaults for some)."""
    fields = {k: v.geometry.get(k) for k in NUMBERS}
    flat, _ = _rope_theta_value(v.geometry)
    fields["rope_theta"] = flat
    for key, value in fields.items():
        if value is None:
            continue
        why = _bad_number(value, *NUMBERS[key])
        if why:
            r.error(key, why, "write the value the drafter was trained with")
    extra = {
        "block_size": (v.block_size, 2, 256),
        "num_target_layers": (v.num_target_layers, 1, 4096),
        "target_hidden_size": (v.target_hidden_size, 1, 2**16),
        "mask_token_id": (v.mask_token_id, 0, 2**31 - 1),
    }
    for key, (value, lo, hi) in extra.items():
        if value is not None and (why := _bad_number(value, "int", lo, hi)):
            r.error(key, why, "write the value the drafter was trained with")
    ids = v.layer_ids
    if ids is not None and not (isinstance(ids, list) and all(is_int(i) for i in ids)):
        r.error("target_layer_ids", f"is {ids!r}", "write a list of 0-based layer ids")
    vocab, mask = fields["vocab_size"], v.mask_token_id
    if isinstance(vocab, int) and is_int(mask) and not 0 <= mask < vocab:
        r.error(
            "mask_token_id",
            f"{mask} outside the vocab 0..{vocab - 1}",
            "pick a token id of the target's vocabulary",
        )


def _rope_theta_value(g: dict[str, Any]) -> tuple[Any, Any]:
    """The raw rope_theta values (flat, nested), unconverted."""
    rp = g.get("rope_parameters")
    nested = rp.get("rope_theta") if isinstance(rp, dict) else None
    return g.get("rope_theta", nested), nested


def check_geometry(v: ConfigView, cfg_dtype: Any, r: CheckReport) -> None:
    g = v.geometry
    check_numbers(v, r)
    flat, nested = _rope_theta_value(g)
    for key, breaks in REQUIRED_GEOMETRY.items():
        # DFlash2 loaders (transformers 5, vLLM, SGLang) read the nested rope_theta.
        if key == "rope_theta" and v.kind == "dflash2" and nested is not None:
            continue
        if g.get(key) is None:
            r.error(key, f"missing: {breaks}", f"write {key} explicitly")
    if g.get("hidden_act", "silu") != "silu":
        r.error("hidden_act", f"is {g['hidden_act']!r}; DFlash MLPs are SwiGLU", 'write "silu"')
    if g.get("tie_word_embeddings") is not False:
        r.error(
            "tie_word_embeddings",
            f"is {g.get('tie_word_embeddings')!r}",
            "write false: the drafter has no lm_head of its own",
        )
    numbers = all(isinstance(x, int | float) for x in (flat, nested))
    if flat is not None and nested is not None and numbers and float(flat) != float(nested):
        r.error(
            "rope_theta",
            f"flat {flat} != rope_parameters.rope_theta {nested}",
            "write the trained value in both places",
        )
    rp = g.get("rope_parameters")
    if isinstance(rp, dict) and rp.get("rope_type", "default") != "default":
        r.error("rope_parameters.rope_type", f"is {rp.get('rope_type')!r}", 'write "default"')
    if g.get("is_neox_style", True) is not True:
        r.error("is_neox_style", "false: interleaved RoPE", "write true (rotate-half RoPE)")
    heads, kv, hd = g.get("num_attention_heads"), g.get("num_key_value_heads"), g.get("head_dim")
    if isinstance(heads, int) and isinstance(kv, int) and (kv <= 0 or heads % kv):
        r.error(
            "num_key_value_heads",
            f"{kv} does not divide num_attention_heads {heads}",
            "use a divisor (grouped-query attention)",
        )
    if isinstance(hd, int) and hd % 2:
        r.error("head_dim", f"{hd} is odd", "RoPE needs an even head_dim")
    _check_layer_types(g, r)
    if not isinstance(v.block_size, int) or v.block_size < 2:
        r.error("block_size", f"is {v.block_size!r}", "write the trained block size (>= 2)")
    n_t = v.num_target_layers
    ids = v.layer_ids
    if isinstance(ids, list) and ids and all(is_int(i) for i in ids):
        if len(set(ids)) != len(ids):
            r.error("target_layer_ids", f"{ids} repeats a layer", "list each tapped layer once")
        if isinstance(n_t, int) and any(not 0 <= i < n_t for i in ids):
            r.error(
                "target_layer_ids",
                f"{ids} out of range for {n_t} target layers",
                "ids are 0-based decoder layers (not hidden_states indices)",
            )
    elif ids == []:
        r.error("target_layer_ids", f"is {ids!r}", "write a non-empty list of layer ids")
    if not isinstance(cfg_dtype, str) or cfg_dtype not in DTYPES:
        r.error("dtype", f"is {cfg_dtype!r}", f"write one of {sorted(DTYPES)}")


def _check_layer_types(g: dict[str, Any], r: CheckReport) -> None:
    lt, n = g.get("layer_types"), g.get("num_hidden_layers")
    if not isinstance(lt, list):
        return
    if len(lt) != n or any(t not in LAYER_TYPES for t in lt):
        r.error(
            "layer_types",
            f"{lt} needs {n} entries from {list(LAYER_TYPES)}",
            "one entry per drafter layer",
        )
    if "sliding_attention" in lt:
        w = g.get("sliding_window")
        if not isinstance(w, int) or w <= 0:
            r.error("sliding_window", f"is {w!r} with sliding layers", "write the trained window")
        if g.get("use_sliding_window") is not True:
            r.error(
                "use_sliding_window",
                "not true with sliding layers: Qwen3Config then drops "
                "the window (z-lab loader runs them as full attention)",
                "write true",
            )


def check_target(v: ConfigView, t: Any, special: set[int], r: CheckReport) -> None:
    g = v.geometry
    pairs = [
        ("hidden_size", g.get("hidden_size"), t.hidden_size),
        ("target_hidden_size", v.target_hidden_size, t.hidden_size),
        ("vocab_size", g.get("vocab_size"), t.vocab_size),
        ("num_target_layers", v.num_target_layers, t.num_hidden_layers),
    ]
    for name, ours, theirs in pairs:
        if ours is not None and ours != theirs:
            r.error(
                name,
                f"{ours} but the target has {theirs}",
                "export against the target the drafter was trained for",
            )
    ids = v.layer_ids if isinstance(v.layer_ids, list) else []
    bad = [i for i in ids if is_int(i) and not 0 <= i < t.num_hidden_layers]
    if bad:
        r.error(
            "target_layer_ids",
            f"{bad} do not exist in the target ({t.num_hidden_layers} layers)",
            "tap layers 0..L-1 of the target",
        )
    if is_int(v.mask_token_id) and v.mask_token_id in special:
        r.error(
            "mask_token_id",
            f"{v.mask_token_id} is the target's EOS/PAD token: every block would end generation",
            "train with a token that is not a stop token",
        )
