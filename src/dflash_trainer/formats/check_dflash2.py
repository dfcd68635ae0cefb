"""The DFlash2 part of `dflash export --check` and of the import's number checks.

A DFlash2 config (architecture `DFlash2DraftModel`, or speculators model type `dflash2`)
carries four numbers that size its convolutions and selector; each has a rule an engine
relies on without checking it (a group size that does not divide the hidden size, a
kernel longer than the block, more candidates than tokens). The attention flags decide
how engines mask sliding layers, which this project cannot serve bidirectionally.
"""

from __future__ import annotations

from typing import Any

from dflash_trainer.formats.check_config import CheckReport, ConfigView, is_int
from dflash_trainer.formats.dflash2_layout import FIELDS, LOGIT_FIELDS

# Sanity limits against a corrupt or hostile config (an import would allocate them).
UPPER = {
    "conv_kernel_size": 256,
    "conv_group_size": 2**16,
    "selector_rank": 2**16,
    "selector_top_k": 2**24,
}


def check_dflash2_numbers(v: ConfigView, r: CheckReport) -> None:
    """Types, ranges and the rules between the four numbers and the geometry."""
    if v.kind != "dflash2":
        return
    ok = {}
    for name in FIELDS:
        value, fld = v.dflash2.get(name), v.dflash2_place + name
        if value is None:
            r.error(fld, "missing: engines size the DFlash2 modules from it", f"write {fld}")
        elif not is_int(value) or not 1 <= value <= UPPER[name]:
            r.error(
                fld,
                f"is {value!r}, not an integer in [1, {UPPER[name]}]",
                "write the trained value",
            )
        else:
            ok[name] = value
    p = v.dflash2_place
    hidden, vocab, block = v.geometry.get("hidden_size"), v.geometry.get("vocab_size"), v.block_size
    g = ok.get("conv_group_size")
    if g and is_int(hidden) and hidden % g:
        r.error(
            p + "conv_group_size",
            f"{g} does not divide hidden_size {hidden}",
            "each group of channels shares one coefficient: use a divisor of hidden_size",
        )
    k = ok.get("conv_kernel_size")
    if k and is_int(block) and k > block:
        r.error(
            p + "conv_kernel_size",
            f"{k} exceeds block_size {block}",
            "taps never leave their block: use at most block_size",
        )
    top_k = ok.get("selector_top_k")
    if top_k and is_int(vocab) and top_k > vocab:
        r.error(
            p + "selector_top_k",
            f"{top_k} exceeds the vocabulary ({vocab} tokens)",
            "use at most vocab_size candidates (default 16)",
        )


def check_dflash2_config(cfg: dict[str, Any], fmt: str, v: ConfigView, r: CheckReport) -> None:
    """Attention flags and target logit transforms (`--check` only; the importer refuses
    the same configs with one error)."""
    if fmt == "zlab":
        _check_is_causal(cfg.get("is_causal", "absent"), v, r)
    for key, neutral in LOGIT_FIELDS.items():  # top level (z-lab: also in dflash_config)
        if key in cfg and cfg[key] != neutral:
            r.error(
                key,
                f"={cfg[key]!r} scales the target's logits or embeddings; this project's "
                "drafters are trained and served without it",
                f"remove it (no transform is {key}={neutral!r})",
            )
    if v.kind != "dflash2":
        return
    types = v.geometry.get("layer_types")
    if isinstance(types, list) and "sliding_attention" in types:
        r.error(
            "layer_types",
            "sliding_attention layers in a DFlash2 drafter: engines run them bidirectionally "
            "inside the block, this project trains them causal there",
            "train the DFlash2 drafter with full_attention layers only",
        )
    if fmt == "speculators" and not isinstance(cfg.get("sliding_window_non_causal"), bool):
        r.error(
            "sliding_window_non_causal",
            f"is {cfg.get('sliding_window_non_causal')!r}",
            "write true (speculators' DFlash2 default; a DFlash2 export has no sliding layers)",
        )


def _check_is_causal(value: Any, v: ConfigView, r: CheckReport) -> None:
    """z-lab: true makes every layer causal; false makes sliding layers bidirectional."""
    types = v.geometry.get("layer_types")
    sliding = isinstance(types, list) and "sliding_attention" in types
    if v.kind == "dflash2" and value is not False:
        r.error(
            "is_causal",
            f"is {value!r}: DFlash2 engines read the published is_causal=false",
            "write false",
        )
    elif v.kind == "dflash" and value is True:
        r.error("is_causal", "true makes full_attention layers causal", "remove it")
    elif v.kind == "dflash" and value is False and sliding:
        r.error(
            "is_causal",
            "false makes sliding layers bidirectional inside the block; they were trained causal",
            "remove it",
        )
