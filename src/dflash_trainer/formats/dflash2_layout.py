"""What the DFlash2 layouts add to DFlash's (docs/formats.md, "DFlash2").

A DFlash2 drafter is the DFlash backbone plus two grouped dynamic convolutions per layer
and a candidate selector (core/dflash2.py). Its engine layouts are DFlash's with:

- `architectures: ["DFlash2DraftModel"]`: the switch every engine reads (a
  `DFlashDraftModel` config loads the same weights as plain DFlash, silently);
- four numbers, `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`
  (z-lab: inside `dflash_config`; speculators: top level);
- per layer `attention_conv` / `mlp_conv` (`base_kernel` [2, k, H] and
  `kernel_projection.weight` [2*k*G, H]) and once `candidate_selector`
  (`hidden_projection.weight` [r, H], `predecessor_codebook` / `successor_codebook`
  [V, r], bare parameters without a `.weight` suffix).

The published DFlash2 configs set `is_causal: false`, which engines read as
"sliding_attention layers are bidirectional inside the block". This project's sliding
layers are causal inside the block (docs/algorithm.md section 2), and no DFlash2 field
makes every engine run them that way, so a DFlash2 export of a drafter with sliding
layers is refused (`sliding_layers_problem`) rather than served wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dflash_trainer.core.geometry import DrafterSpec, dflash2_problems
from dflash_trainer.errors import DFlashError

ARCHITECTURE_V2 = "DFlash2DraftModel"
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# Target-specific logit / embedding transforms a DFlash2 config may carry, with the
# value that means "none". The targets this project trains for have none, and neither
# training nor serving applies them: any other value would be served wrong.
LOGIT_FIELDS: dict[str, Any] = {
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    "input_embedding_scale": 1.0,
}

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def logit_field_problem(key: str, value: Any, where: str) -> str:
    return (
        f"{where}: {key}={value!r} scales the target's logits or embeddings (a "
        "target-specific transform, e.g. for Muse Glimmer); this project's drafters are "
        "trained and served without it, so this drafter would be served wrong. Only "
        f"drafters without it (or with {key}={LOGIT_FIELDS[key]!r}) can be imported"
    )


def sliding_layers_problem(spec: DrafterSpec) -> str | None:
    """Why `spec` has no faithful DFlash2 export, or None."""
    sliding = [i for i, t in enumerate(spec.layer_types) if t == "sliding_attention"]
    if not sliding:
        return None
    return (
        f"layers {sliding} are sliding_attention; this project runs them causal inside the "
        "block, but DFlash2 engines (z-lab, vLLM, SGLang) read the layout's is_causal=false "
        "as bidirectional sliding layers, and no DFlash2 field says otherwise, so the "
        "export would be served wrong. Train the DFlash2 drafter with full_attention "
        "layers only (drafter.layer_types)"
    )


def export_fields(spec: DrafterSpec) -> dict[str, int]:
    """The four numbers, after refusing a drafter the layout cannot describe."""
    problems = [p for p in [sliding_layers_problem(spec)] if p] + dflash2_problems(spec)
    if problems:
        raise DFlashError(f"cannot export this DFlash2 drafter: {problems[0]}")
    return {name: int(getattr(spec, name)) for name in FIELDS}


def read_fields(src: dict[str, Any], where: str, place: str) -> dict[str, int]:
    """The four numbers of a DFlash2 config (`place` names where they live)."""
    out = {}
    for name in FIELDS:
        value = src.get(name)
        if value is None:
            raise DFlashError(
                f"{where}: {place}{name} is missing; a DFlash2 config needs all of "
                f"{list(FIELDS)} (engines size the convolutions and the selector from them)"
            )
        if isinstance(value, bool) or not isinstance(value, int):
            raise DFlashError(f"{where}: {place}{name}={value!r} must be an integer")
        out[name] = value
    return out


def with_fields(spec: DrafterSpec, src: dict[str, Any], where: str, place: str) -> DrafterSpec:
    """`spec` as a DFlash2 drafter with the four numbers read from `src`; refused where
    they cannot build one (the rules of `dflash doctor`)."""
    fields = read_fields(src, where, place)
    small = [f"{place}{k}={v}" for k, v in fields.items() if v < 1]
    if small:
        raise DFlashError(f"{where}: {', '.join(small)}: each DFlash2 number must be >= 1")
    out = dataclasses.replace(
        spec,
        kind="dflash2",
        conv_kernel_size=fields["conv_kernel_size"],
        conv_group_size=fields["conv_group_size"],
        selector_rank=fields["selector_rank"],
        selector_top_k=fields["selector_top_k"],
    )
    problems = dflash2_problems(out)
    if problems:
        raise DFlashError(f"{where}: not a buildable DFlash2 drafter: {problems[0]}")
    return out


def tensor_shapes(spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
    """The tensors DFlash2 adds, by their published names (empty for DFlash)."""
    if not spec.is_dflash2:
        return {}
    h, k = spec.hidden_size, spec.conv_kernel_size
    groups = h // spec.conv_group_size if spec.conv_group_size > 0 else 0
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(spec.num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * groups, h)
    r = spec.selector_rank
    shapes["candidate_selector.hidden_projection.weight"] = (r, h)
    for name in CODEBOOKS:
        shapes[name] = (spec.vocab_size, r)
    return shapes


def bare_codebooks(
    state: dict[str, torch.Tensor], where: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Codebooks saved as `<name>.weight` (an nn.Embedding's state dict, as the z-lab
    reference module saves them) under their published bare names, and what was renamed."""
    renamed = []
    out = dict(state)
    for name in CODEBOOKS:
        suffixed = name + ".weight"
        if suffixed not in out:
            continue
        if name in out:
            raise DFlashError(
                f"{where}: holds both {name} and {suffixed}; keep one copy of the codebook"
            )
        out[name] = out.pop(suffixed)
        renamed.append(suffixed)
    notes = [f"{where}: read {renamed} as the published bare names (no .weight)"] if renamed else []
    return out, notes


def kind_mismatch(kind: str, names: set[str]) -> tuple[str, str] | None:
    """(problem, fix) when a config's kind and its tensors disagree, else None."""
    extra = sorted(n for n in names if n.startswith("candidate_selector.") or "_conv." in n)
    if kind == "dflash" and extra:
        return (
            f"the config says DFlashDraftModel but the weights hold DFlash2 modules "
            f"({extra[:2]}...): engines would load them as plain DFlash and ignore the "
            "convolutions and the selector",
            f'write architectures ["{ARCHITECTURE_V2}"] with the four DFlash2 fields, or '
            "export the drafter again",
        )
    if kind == "dflash2" and not extra:
        return (
            f"the config says {ARCHITECTURE_V2} but the weights are a DFlash drafter's (no "
            "attention_conv / mlp_conv / candidate_selector tensors)",
            'write architectures ["DFlashDraftModel"] without the DFlash2 fields, or export '
            "the DFlash2 drafter",
        )
    return None
