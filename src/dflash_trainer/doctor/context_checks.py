"""The doctor's checks of how far the drafter sees: RoPE positions against the target's
and the training lengths, and sliding windows against the block and the documents.
"""

from __future__ import annotations

from typing import Any

from dflash_trainer.config import Config
from dflash_trainer.core.geometry import rope_theta_of
from dflash_trainer.doctor.report import Check


def check_rope(cfg: Config, t: Any) -> list[Check]:
    out: list[Check] = []
    d = cfg.drafter
    rp = getattr(t, "rope_parameters", None)
    nested = rp.get("rope_theta") if isinstance(rp, dict) else None
    flat = t.__dict__.get("rope_theta")
    target_theta = rope_theta_of(t)
    if nested is not None and flat is not None and float(nested) != float(flat):
        out.append(
            Check(
                "rope.fields",
                "warn",
                f"the target config has rope_theta={flat} flat but {nested} in rope_parameters",
                "fix the target's config.json; exports write both for old loaders",
            )
        )
    theta = d.rope_theta or target_theta
    src = "drafter.rope_theta" if d.rope_theta else "the target's"
    out.append(
        Check(
            "rope.theta",
            "pass",
            f"rope_theta={theta:g} ({src}), written flat and nested in exports",
        )
    )
    partial = (
        rp.get("partial_rotary_factor")
        if isinstance(rp, dict)
        else getattr(t, "partial_rotary_factor", None)
    )
    extras = []
    if partial not in (None, 1.0):
        extras.append(f"partial_rotary_factor={partial}")
    if isinstance(rp, dict) and rp.get("mrope_section"):
        extras.append("mrope")
    rtype = rp.get("rope_type") if isinstance(rp, dict) else None
    if rtype not in (None, "default"):
        out.append(
            Check(
                "rope.scaling",
                "warn",
                f"the target uses rope_type={rtype}; the drafter uses plain RoPE",
                "set drafter.max_position_embeddings to the lengths you serve",
            )
        )
    if extras:
        out.append(
            Check(
                "rope.partial",
                "pass",
                f"target uses {', '.join(extras)}; the drafter applies full RoPE over its own "
                "head_dim (its positions are its own, nothing is shared)",
            )
        )
    max_pos = d.max_position_embeddings or getattr(t, "max_position_embeddings", None)
    if max_pos and cfg.data.doc_limit > max_pos:
        out.append(
            Check(
                "rope.max_position",
                "warn",
                f"data.max_doc_tokens/token_budget ({cfg.data.doc_limit}) exceeds "
                f"max_position_embeddings={max_pos}",
                "lower data.max_doc_tokens or raise drafter.max_position_embeddings",
            )
        )
    return out


def check_sliding(cfg: Config) -> list[Check]:
    d = cfg.drafter
    types = d.resolved_layer_types()
    w = d.sliding_window
    sliding = types.count("sliding_attention")
    if not sliding:
        if w:
            return [
                Check(
                    "sliding.unused",
                    "warn",
                    f"drafter.sliding_window={w} is set but drafter.layer_types has no sliding layers",
                    "add sliding_attention layers or drop sliding_window",
                )
            ]
        return [Check("sliding.layers", "pass", f"{len(types)} full-attention layers")]
    out: list[Check] = []
    assert w is not None  # config validation requires it with sliding layers
    if sliding == len(types):
        out.append(
            Check(
                "sliding.no_full",
                "warn",
                "every drafter layer slides: no layer sees context further back than "
                f"drafter.sliding_window={w}",
                "make at least one layer full_attention (the published drafter: 4 sliding + 1 full)",
            )
        )
    if w < d.block_size:
        out.append(
            Check(
                "sliding.block",
                "warn",
                f"drafter.sliding_window={w} < drafter.block_size={d.block_size}: late slots "
                "cannot see the anchor",
                "use a window of at least the block size",
            )
        )
    if w >= cfg.data.doc_limit:
        out.append(
            Check(
                "sliding.length",
                "warn",
                f"drafter.sliding_window={w} >= the longest training document "
                f"({cfg.data.doc_limit} tokens): sliding layers train as full ones and never "
                "learn the window they serve with",
                "train on longer documents or use a smaller window",
            )
        )
    if not out:
        out.append(
            Check("sliding.layers", "pass", f"{sliding} of {len(types)} layers slide, window {w}")
        )
    return out
