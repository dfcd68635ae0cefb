"""The doctor's checks of the drafter's shape against its target: attention geometry,
tapped layers, tensor parallelism and a drafter to start from.

The geometry comes from `core.geometry.attention_geometry`, the rule training uses, so
the doctor reports exactly the heads / KV heads / head dim a run would build and every
rule they break (training stops at the first). Messages name the config fields
(`drafter.num_attention_heads`, ...) because that is what a user edits.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dflash_trainer.config import Config, ConfigError
from dflash_trainer.core.geometry import (
    AttentionGeometry,
    DrafterSpec,
    attention_geometry,
    default_target_layer_ids,
    dflash2_problems,
    init_differences,
    resolve_drafter_spec,
    target_layer_ids,
    text_config,
)
from dflash_trainer.doctor.report import Check, Status
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import read_small_text

# Published DFlash drafters, keyed by (model_type, hidden, layers) of their target, so a
# local copy of the target is recognised too. Geometry: z-lab's drafter configs.
PUBLISHED_DRAFTERS: dict[tuple[str, int, int], dict[str, Any]] = {
    ("qwen3_5_text", 5120, 64): {
        "name": "z-lab Qwen3.6-27B DFlash drafter (1.7B)",
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    ("qwen3", 4096, 36): {
        "name": "z-lab Qwen3-8B DFlash drafter",
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}


def target_geometry(t: Any) -> tuple[int, int, int]:
    heads = int(t.num_attention_heads)
    kv = int(getattr(t, "num_key_value_heads", None) or heads)
    hd = int(getattr(t, "head_dim", None) or t.hidden_size // heads)
    return heads, kv, hd


def check_geometry(cfg: Config, t: Any) -> list[Check]:
    hidden, vocab = int(t.hidden_size), int(t.vocab_size)
    n_taps = len(target_layer_ids(cfg.drafter, int(t.num_hidden_layers)))
    out = [
        Check(
            "geometry.shared",
            "pass",
            f"hidden_size={hidden}, vocab_size={vocab} and fc input {n_taps}"
            f"x{hidden} come from the target (shared embed_tokens / lm_head)",
        )
    ]
    g = attention_geometry(cfg.drafter, hidden)
    if "unset" in g.broken:
        out.append(
            Check(
                "geometry.chosen",
                "fail",
                "drafter.num_attention_heads / drafter.num_key_value_heads are unset and "
                "drafter.geometry is null",
                "set drafter.geometry=qwen3 (32/8/128) or give the three fields explicitly",
            )
        )
        return out
    out.append(_divisibility(cfg, hidden, g))
    out.append(_grouped_query(g))
    out.extend(_head_dim(g))
    out.extend(_copied_geometry(cfg, t, g))
    out.extend(_tensor_parallel(cfg, g))
    return out


def _divisibility(cfg: Config, hidden: int, g: AttentionGeometry) -> Check:
    """A llama-class drafter derives head_dim from hidden_size; a qwen3 one chooses it."""
    d = cfg.drafter
    assert g.heads is not None
    if "llama_divisibility" in g.broken:
        return Check(
            "geometry.divisibility",
            "fail",
            f"drafter.layer_class=llama needs hidden_size % drafter.num_attention_heads == 0, "
            f"but {hidden} % {g.heads} = {hidden % g.heads}: LlamaConfig rejects such a drafter",
            f"use drafter.layer_class=qwen3 (free head_dim), or a head count dividing {hidden}",
        )
    if "llama_head_dim" in g.broken:
        return Check(
            "geometry.divisibility",
            "fail",
            f"drafter.head_dim={d.head_dim} but a llama-class drafter has head_dim = "
            f"hidden_size / num_attention_heads = {hidden // g.heads}",
            "drop drafter.head_dim or use drafter.layer_class=qwen3",
        )
    return Check(
        "geometry.divisibility",
        "pass",
        f"layer_class={d.layer_class}: {g.heads} heads x head_dim {g.head_dim}",
    )


def _grouped_query(g: AttentionGeometry) -> Check:
    assert g.heads is not None and g.kv_heads is not None
    if "gqa" in g.broken:
        return Check(
            "geometry.gqa",
            "fail",
            f"drafter.num_attention_heads={g.heads} is not a multiple of "
            f"drafter.num_key_value_heads={g.kv_heads}",
            "choose KV heads that divide the query heads (e.g. 32/8)",
        )
    return Check("geometry.gqa", "pass", f"{g.heads // g.kv_heads} query heads per KV head")


def _head_dim(g: AttentionGeometry) -> list[Check]:
    """Odd breaks RoPE (fail); off the kernels' multiples of 8 up to 256 is slow (warn)."""
    if g.head_dim is None or not (g.head_dim % 2 or g.head_dim % 8 or g.head_dim > 256):
        return []
    status: Status = "fail" if "rope_even" in g.broken else "warn"
    return [
        Check(
            "geometry.head_dim",
            status,
            f"drafter.head_dim={g.head_dim}: RoPE needs it even, and serving attention "
            "kernels want a multiple of 8 up to 256",
            "use 64, 128 or 256",
        )
    ]


def _copied_geometry(cfg: Config, t: Any, g: AttentionGeometry) -> list[Check]:
    th, tkv, thd = target_geometry(t)
    key = (str(t.model_type), int(t.hidden_size), int(t.num_hidden_layers))
    published = PUBLISHED_DRAFTERS.get(key)
    mine = (g.heads, g.kv_heads, g.head_dim)
    fields = "drafter.num_attention_heads/num_key_value_heads/head_dim"
    if mine != (th, tkv, thd):
        return [
            Check(
                "geometry.independent",
                "pass",
                f"attention geometry {g.heads}/{g.kv_heads}/{g.head_dim} ({g.source}); the target "
                f"has {th}/{tkv}/{thd}",
            )
        ]
    if published is None:
        return [
            Check(
                "geometry.copied",
                "warn",
                f"{fields} = {th}/{tkv}/{thd} equal the target's: a copy rather than a choice; "
                "the drafter's attention geometry is its own, and the target's head geometry "
                "usually gives a bigger, slower drafter (docs/algorithm.md section 1)",
                "choose it deliberately (e.g. drafter.geometry=qwen3) and keep it if intended",
            )
        ]
    pub = (
        published["num_attention_heads"],
        published["num_key_value_heads"],
        published["head_dim"],
    )
    sizes = ""
    try:
        sizes = f"{_params(cfg, t, mine) / 1e9:.2f}B params vs {_params(cfg, t, pub) / 1e9:.2f}B, "
    except ConfigError:
        pass
    if pub == mine:
        return [
            Check(
                "geometry.copied",
                "pass",
                f"{g.heads}/{g.kv_heads}/{g.head_dim} equals the target's and the {published['name']}",
            )
        ]
    return [
        Check(
            "geometry.copied",
            "fail",
            f"{fields} = {th}/{tkv}/{thd} copy the target {getattr(t, 'model_type', '')}: "
            f"a different model than the {published['name']} "
            f"({pub[0]}/{pub[1]}/{pub[2]}; {sizes}its weights cannot load into it)",
            f"set drafter.geometry=qwen3 (or {pub[0]}/{pub[1]}/{pub[2]} explicitly) and leave "
            "the target's attention geometry to the target",
        )
    ]


def _params(cfg: Config, t: Any, geometry: tuple[Any, ...]) -> int:
    from dflash_trainer.plan.flops import drafter_params

    heads, kv, hd = geometry
    d = dataclasses.replace(
        cfg.drafter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        layer_class="qwen3",
    )
    return drafter_params(resolve_drafter_spec(d, t))


def _tensor_parallel(cfg: Config, g: AttentionGeometry) -> list[Check]:
    tp = cfg.distributed.tensor_parallel_size
    assert g.heads is not None and g.kv_heads is not None
    if tp == 1:
        return [Check("geometry.tensor_parallel", "pass", "tensor_parallel_size=1")]
    if g.heads % tp:
        return [
            Check(
                "geometry.tensor_parallel",
                "fail",
                f"drafter.num_attention_heads={g.heads} is not divisible by "
                f"distributed.tensor_parallel_size={tp}",
                "pick a head count divisible by the serving TP size",
            )
        ]
    if g.kv_heads % tp and tp % g.kv_heads:
        return [
            Check(
                "geometry.tensor_parallel",
                "fail",
                f"drafter.num_key_value_heads={g.kv_heads} neither divides nor is divided by "
                f"distributed.tensor_parallel_size={tp}",
                "use KV heads that divide TP or are a multiple of it",
            )
        ]
    status: Status = "warn" if g.kv_heads < tp else "pass"
    note = " (KV heads replicated across ranks)" if g.kv_heads < tp else ""
    return [Check("geometry.tensor_parallel", status, f"heads split over TP={tp}{note}")]


def check_layers(cfg: Config, t: Any) -> list[Check]:
    n = int(t.num_hidden_layers)
    ids = target_layer_ids(cfg.drafter, n)
    src = "drafter.target_layer_ids" if cfg.drafter.target_layer_ids else "default formula"
    out: list[Check] = []
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        out.append(
            Check(
                "layers.range",
                "fail",
                f"drafter.target_layer_ids {bad} out of range for a target with {n} layers "
                f"(valid 0..{n - 1}; ids are 0-based decoder layers, not hidden_states indices)",
                f"use ids in 0..{n - 1}, e.g. the default {list(default_target_layer_ids(n, len(ids)))}",
            )
        )
    else:
        out.append(Check("layers.range", "pass", f"{list(ids)} ({src}) within 0..{n - 1}"))
    if len(set(ids)) != len(ids):
        out.append(
            Check(
                "layers.distinct",
                "fail",
                f"drafter.target_layer_ids {list(ids)} repeat",
                "tap each layer once",
            )
        )
    kinds = list(getattr(t, "layer_types", None) or [])
    if len(set(kinds)) > 1 and not bad:
        tapped = {kinds[i] for i in ids}
        if len(tapped) == 1:
            out.append(
                Check(
                    "layers.hybrid",
                    "warn",
                    f"all drafter.target_layer_ids {list(ids)} are {tapped.pop()} layers of a hybrid "
                    f"target ({', '.join(sorted(set(kinds)))})",
                    "include layers of each kind (the default spread does)",
                )
            )
        else:
            per = {k: [i for i in ids if kinds[i] == k] for k in sorted(tapped)}
            out.append(Check("layers.hybrid", "pass", f"taps span layer kinds: {per}"))
    out.append(
        Check(
            "layers.recorded",
            "pass",
            f"num_target_layers={n} and target_layer_ids={list(ids)} are written to the drafter "
            "spec and exports (engines add 1 themselves: not pre-shifted)",
        )
    )
    return out


def _init_from_spec(path: str) -> DrafterSpec:
    """The geometry of the drafter at `path` without reading its weights: this tool's
    spec.json, else a z-lab export's config.json (what `drafter.init_from` also accepts)."""
    from pathlib import Path

    from dflash_trainer.formats.check import read_config
    from dflash_trainer.formats.drafter_io import SPEC_FILE, resolve_drafter_dir
    from dflash_trainer.formats.export import detect_format
    from dflash_trainer.formats.zlab import spec_from_zlab_config

    try:
        text = read_small_text(resolve_drafter_dir(path) / SPEC_FILE, "drafter spec")
        return DrafterSpec.from_dict(json.loads(text))
    except DFlashError:
        p = Path(path)
        if not (p.is_dir() and detect_format(p) == "zlab"):
            raise
        return spec_from_zlab_config(read_config(p), str(p / "config.json"))[0]


def check_init_from(cfg: Config, t: Any) -> list[Check]:
    """A drafter to start from must match the target's shared dims and this geometry."""
    path = cfg.drafter.init_from
    if not path:
        return []
    try:
        theirs = _init_from_spec(path)
    except (DFlashError, ValueError, RecursionError, TypeError, KeyError, AttributeError) as e:
        return [
            Check(
                "geometry.init_from",
                "skip",
                f"drafter.init_from={path}: no drafter geometry to compare ({e})",
                "give a run directory, this tool's drafter files or a z-lab export; "
                "for a speculators export, `dflash import` it first",
            )
        ]
    try:
        mine = resolve_drafter_spec(cfg.drafter, t)
    except ConfigError:
        return []  # the geometry checks above already fail
    diffs = init_differences(theirs, mine)
    if diffs:
        shown = ", ".join(f"{k}: {a} there vs {b} here" for k, (a, b) in sorted(diffs.items()))
        return [
            Check(
                "geometry.init_from",
                "fail",
                f"drafter.init_from={path} differs from this config and target: {shown}",
                "make the drafter section (and the target) match the drafter you start from",
            )
        ]
    return [Check("geometry.init_from", "pass", f"drafter.init_from={path} matches this config")]


def check_dflash2(cfg: Config, t: Any) -> list[Check]:
    """DFlash2's fields against the target: every broken rule, and the vocabulary the
    selector indexes (the target's whole lm_head: no pruned draft vocabulary)."""
    d = cfg.drafter
    if d.kind != "dflash2":
        return []
    hidden, vocab = int(text_config(t).hidden_size), int(text_config(t).vocab_size)
    spec = DrafterSpec(
        hidden_size=hidden,
        vocab_size=vocab,
        target_hidden_size=hidden,
        num_target_hidden_layers=int(text_config(t).num_hidden_layers),
        target_layer_ids=(0,),
        block_size=d.block_size,
        mask_token_id=0,
        num_layers=d.num_layers,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=2,
        intermediate_size=1,
        rope_theta=1.0,
        layer_types=d.resolved_layer_types(),
        sliding_window=d.sliding_window,
        rms_norm_eps=d.rms_norm_eps,
        max_position_embeddings=1,
        kind="dflash2",
        conv_kernel_size=d.conv_kernel_size,
        conv_group_size=d.conv_group_size,
        selector_rank=d.selector_rank,
        selector_top_k=d.selector_top_k,
    )
    problems = dflash2_problems(spec)
    if problems:
        return [
            Check("geometry.dflash2", "fail", p, "change the named drafter field") for p in problems
        ]
    groups = hidden // d.conv_group_size
    codebooks = 2 * vocab * d.selector_rank
    return [
        Check(
            "geometry.dflash2",
            "pass",
            f"{d.conv_kernel_size} taps, {groups} groups of {d.conv_group_size} channels; the "
            f"selector ranks {d.selector_top_k} of the target's {vocab} tokens (its two "
            f"codebooks hold {codebooks / 1e6:.1f}M parameters)",
        )
    ]
