"""The doctor's checks: each a pure function of the config, the target's HF config and
(optionally) the data, returning `Check` lines with a fix.

Every check reports what it found even when it passes, so a log of `dflash doctor`
says which geometry, layer ids and mask token a run used. Messages name the config
fields (`drafter.num_attention_heads`, ...) because that is what a user edits.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dflash_trainer.config import GEOMETRY_PRESETS, Config, ConfigError
from dflash_trainer.core.geometry import default_target_layer_ids, rope_theta_of

Status = Literal["pass", "warn", "fail", "skip"]

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


@dataclass(frozen=True)
class Check:
    id: str
    status: Status
    message: str
    fix: str = ""


@dataclass(frozen=True)
class Geometry:
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    source: str


def target_geometry(t: Any) -> tuple[int, int, int]:
    heads = int(t.num_attention_heads)
    kv = int(getattr(t, "num_key_value_heads", None) or heads)
    hd = int(getattr(t, "head_dim", None) or t.hidden_size // heads)
    return heads, kv, hd


def drafter_geometry(cfg: Config, hidden: int) -> Geometry:
    """The drafter's heads / KV heads / head dim as resolve_drafter_spec would pick them."""
    d = cfg.drafter
    preset = GEOMETRY_PRESETS.get(d.geometry or "", {})
    heads = d.num_attention_heads or preset.get("num_attention_heads")
    kv = d.num_key_value_heads or preset.get("num_key_value_heads")
    hd = d.head_dim or preset.get("head_dim")
    explicit = [
        n for n in ("num_attention_heads", "num_key_value_heads", "head_dim") if getattr(d, n)
    ]
    source = f"preset {d.geometry}" if preset else "explicit fields"
    if preset and explicit:
        source += " + explicit " + ", ".join(explicit)
    if d.layer_class == "llama" and heads:
        hd = hidden // heads if hidden % heads == 0 else None
    return Geometry(heads, kv, hd, source)


def check_geometry(cfg: Config, t: Any) -> list[Check]:
    out: list[Check] = []
    d = cfg.drafter
    hidden, vocab = int(t.hidden_size), int(t.vocab_size)
    out.append(
        Check(
            "geometry.shared",
            "pass",
            f"hidden_size={hidden}, vocab_size={vocab} and fc input {len(_layer_ids(cfg, t))}"
            f"x{hidden} come from the target (shared embed_tokens / lm_head)",
        )
    )
    g = drafter_geometry(cfg, hidden)
    if g.heads is None or g.kv_heads is None:
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
    if d.layer_class == "llama" and hidden % g.heads:
        out.append(
            Check(
                "geometry.divisibility",
                "fail",
                f"drafter.layer_class=llama needs hidden_size % drafter.num_attention_heads == 0, "
                f"but {hidden} % {g.heads} = {hidden % g.heads} (seed: LlamaConfig rejects 24 heads "
                "on hidden 5120)",
                f"use drafter.layer_class=qwen3 (free head_dim), or a head count dividing {hidden}",
            )
        )
    elif d.layer_class == "llama" and d.head_dim and d.head_dim != hidden // g.heads:
        out.append(
            Check(
                "geometry.divisibility",
                "fail",
                f"drafter.head_dim={d.head_dim} but a llama-class drafter has head_dim = "
                f"hidden_size / num_attention_heads = {hidden // g.heads}",
                "drop drafter.head_dim or use drafter.layer_class=qwen3",
            )
        )
    else:
        out.append(
            Check(
                "geometry.divisibility",
                "pass",
                f"layer_class={d.layer_class}: {g.heads} heads x head_dim {g.head_dim}",
            )
        )
    if g.heads % g.kv_heads:
        out.append(
            Check(
                "geometry.gqa",
                "fail",
                f"drafter.num_attention_heads={g.heads} is not a multiple of "
                f"drafter.num_key_value_heads={g.kv_heads}",
                "choose KV heads that divide the query heads (e.g. 32/8)",
            )
        )
    else:
        out.append(
            Check("geometry.gqa", "pass", f"{g.heads // g.kv_heads} query heads per KV head")
        )
    if g.head_dim is not None and (g.head_dim % 2 or g.head_dim % 8 or g.head_dim > 256):
        status: Status = "fail" if g.head_dim % 2 else "warn"
        out.append(
            Check(
                "geometry.head_dim",
                status,
                f"drafter.head_dim={g.head_dim}: RoPE needs it even, and serving attention "
                "kernels want a multiple of 8 up to 256",
                "use 64, 128 or 256",
            )
        )
    out.extend(_copied_geometry(cfg, t, g))
    out.extend(_tensor_parallel(cfg, g))
    return out


def _copied_geometry(cfg: Config, t: Any, g: Geometry) -> list[Check]:
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
                f"{fields} = {th}/{tkv}/{thd} equal the target's: a copy (seed Bug 1) rather "
                "than a choice; the drafter's attention geometry is its own",
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
            f"{fields} = {th}/{tkv}/{thd} copy the target {getattr(t, 'model_type', '')} "
            f"(seed Bug 1): a different model than the {published['name']} "
            f"({pub[0]}/{pub[1]}/{pub[2]}; {sizes}its weights cannot load into it)",
            f"set drafter.geometry=qwen3 (or {pub[0]}/{pub[1]}/{pub[2]} explicitly) and leave "
            "the target's attention geometry to the target",
        )
    ]


def _params(cfg: Config, t: Any, geometry: tuple[Any, ...]) -> int:
    from dflash_trainer.core.geometry import resolve_drafter_spec
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


def _tensor_parallel(cfg: Config, g: Geometry) -> list[Check]:
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


def _layer_ids(cfg: Config, t: Any) -> tuple[int, ...]:
    d = cfg.drafter
    return d.target_layer_ids or default_target_layer_ids(
        int(t.num_hidden_layers), d.num_target_layers
    )


def check_layers(cfg: Config, t: Any) -> list[Check]:
    n = int(t.num_hidden_layers)
    ids = _layer_ids(cfg, t)
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


def stop_and_pad_ids(t: Any, generation_config: dict[str, Any] | None) -> dict[int, str]:
    out: dict[int, str] = {}
    for src in [t, generation_config or {}]:
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = src.get(key) if isinstance(src, dict) else getattr(src, key, None)
            for i in value if isinstance(value, list) else [value]:
                if i is not None:
                    out.setdefault(int(i), key)
    return out


def check_mask_token(
    cfg: Config,
    t: Any,
    generation_config: dict[str, Any] | None,
    tokenizer: Any | None,
    occurrences: tuple[int, int, str] | None,
) -> list[Check]:
    """`occurrences`: (count, tokens scanned, first document id) from the data, or None."""
    m = cfg.drafter.mask_token_id
    vocab = int(t.vocab_size)
    if m is None:
        return [
            Check(
                "mask.set",
                "fail",
                "drafter.mask_token_id is not set",
                "pick an id that never occurs in the data and is not EOS/PAD "
                "(Qwen3: 151669, Qwen3.5/3.6: 248070, SmolLM2: 16)",
            )
        ]
    out: list[Check] = []
    if not 0 <= m < vocab:
        out.append(
            Check(
                "mask.vocab",
                "fail",
                f"drafter.mask_token_id={m} is outside the vocab 0..{vocab - 1}",
                "use an id inside the target's embedding table",
            )
        )
        return out
    out.append(
        Check("mask.vocab", "pass", f"drafter.mask_token_id={m} inside the vocab (0..{vocab - 1})")
    )
    special = stop_and_pad_ids(t, generation_config)
    if m in special:
        out.append(
            Check(
                "mask.special",
                "fail",
                f"drafter.mask_token_id={m} is the target's {special[m]}: a drafted mask would "
                "end generation or be ignored as padding",
                "use a token that is neither EOS, PAD nor BOS",
            )
        )
    else:
        out.append(
            Check("mask.special", "pass", f"not EOS/PAD/BOS ({sorted(special) or 'none set'})")
        )
    if tokenizer is not None:
        n_tok = len(tokenizer)
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        specials |= {
            i
            for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if getattr(tok, "special", False)
        }
        if m >= n_tok:
            out.append(
                Check(
                    "mask.tokenizer",
                    "pass",
                    f"id {m} is an unused embedding row (tokenizer has {n_tok})",
                )
            )
        elif m in specials:
            name = tokenizer.convert_ids_to_tokens(m)
            out.append(Check("mask.tokenizer", "pass", f"id {m} is the special token {name!r}"))
        else:
            name = tokenizer.convert_ids_to_tokens(m)
            out.append(
                Check(
                    "mask.tokenizer",
                    "warn",
                    f"drafter.mask_token_id={m} is the ordinary token {name!r}: it may occur in real text",
                    "prefer a special token never used in chat or an unused embedding row",
                )
            )
    else:
        out.append(
            Check("mask.tokenizer", "skip", "no local tokenizer: special-token check skipped")
        )
    if occurrences is None:
        out.append(
            Check("mask.data", "skip", "no data given: occurrence check skipped", "pass --data DIR")
        )
    else:
        count, scanned, first = occurrences
        if count:
            out.append(
                Check(
                    "mask.data",
                    "fail",
                    f"drafter.mask_token_id={m} occurs {count} times in {scanned:,} scanned tokens of "
                    f"the training data (first in document {first}): the drafter could not tell a "
                    "masked slot from a real token",
                    "choose a mask id that never occurs in the data",
                )
            )
        else:
            out.append(
                Check("mask.data", "pass", f"id {m} absent from {scanned:,} scanned data tokens")
            )
    return out


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


def check_training(cfg: Config, cuda_expected: bool) -> list[Check]:
    t = cfg.training
    out: list[Check] = []
    if t.noise_std == 0:
        out.append(
            Check(
                "training.noise",
                "warn",
                "training.noise_std=0: no noise on the context features (seed Bug 3)",
                "use training.noise_std=0.05",
            )
        )
    if not t.pack_documents:
        out.append(
            Check(
                "training.packing",
                "warn",
                "training.pack_documents=false: one drafter forward per document (seed Bug 2, ~4x slower)",
                "leave packing on except for benchmarks",
            )
        )
    if cuda_expected and t.compile is False:
        out.append(
            Check(
                "training.compile",
                "warn",
                "training.compile=false on a GPU run: attention runs unfused (seed Bug 6), see memory.unfused",
                "leave training.compile unset (on with CUDA)",
            )
        )
    if not out:
        out.append(Check("training.settings", "pass", "noise, packing and compile as recommended"))
    return out


def check_compile_cache(cfg: Config, world: int, hybrid: bool, env: dict[str, str]) -> list[Check]:
    if world <= 1:
        return [Check("compile.cache", "pass", "single process: one compile cache")]
    compiled = cfg.training.compile is not False
    if compiled:
        return [
            Check(
                "compile.cache",
                "pass",
                f"{world} processes: the trainer gives each rank RUN/compile_cache/rank<r> "
                "(TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) and compiles one rank at a time",
            )
        ]
    shared = env.get("TRITON_CACHE_DIR", "~/.triton/cache")
    if hybrid:
        return [
            Check(
                "compile.cache",
                "warn",
                f"{world} processes with training.compile=false share the Triton cache {shared}, "
                "while the hybrid target's Triton kernels (fla) autotune in every rank (seed: "
                "corrupted cache)",
                "export a per-rank TRITON_CACHE_DIR (e.g. /tmp/triton-$LOCAL_RANK) or keep compile on",
            )
        ]
    return [Check("compile.cache", "pass", f"{world} processes, nothing compiled with Triton")]


def scan_tokens(
    docs: Iterable[Sequence[int] | Any], token: int, doc_ids: Iterable[str]
) -> tuple[int, int, str]:
    """(occurrences of `token`, tokens scanned, first document id containing it)."""
    import numpy as np

    count = scanned = 0
    first = ""
    for ids, doc_id in zip(docs, doc_ids):
        arr = np.asarray(ids)
        hits = int((arr == token).sum())
        if hits and not first:
            first = doc_id
        count += hits
        scanned += int(arr.size)
    return count, scanned, first


def environment() -> dict[str, str]:
    return dict(os.environ)
