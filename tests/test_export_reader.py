"""Parity with an independent reader of the exported files.

`reference_draft` below is written from the format description only (docs/formats.md,
docs/algorithm.md sections 1-2): plain torch ops over the tensors in model.safetensors
and the numbers in config.json. It shares no code with the project's model class, so
an export that differs from what `DFlashDrafter.step` computes (a swapped tensor, a
wrong rope_theta, a window applied differently) makes these tests fail. For a DFlash2
export it also runs the two-sided grouped convolutions (`reference_conv`) and walks the
candidate selector slot by slot (`reference_walk`), from the DFlash2 section of
docs/formats.md; tests/test_export_dflash2.py holds those comparisons.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_spec
from safetensors.torch import load_file, save_file

from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.formats.drafter_io import save_drafter_files
from dflash_trainer.formats.export import export_drafter, import_drafter

FIXTURES = Path(__file__).parent / "fixtures"
# The reader is float64 throughout; the project's model (like HF's rotary embedding)
# computes RoPE angles in float32 even when run in float64, which bounds agreement
# at ~1e-7. A real format mistake (rope_theta, window, a swapped tensor) moves the
# outputs by orders of magnitude more: see the sensitivity test at the end.
TOL = 2e-6

# ------------------------------------------------------------ the independent reader


DFLASH2_NUMBERS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def read_export(d: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(decoder config, float64 weights); a DFlash2 export's numbers under cfg["dflash2"]."""
    raw = json.loads((d / "config.json").read_text())
    cfg = dict(raw.get("transformer_layer_config", raw))  # speculators: the decoder is nested
    if raw.get("architectures") == ["DFlash2DraftModel"]:
        # z-lab: inside dflash_config; speculators: at the top level.
        src = raw if "speculators_model_type" in raw else raw["dflash_config"]
        cfg["dflash2"] = {k: src[k] for k in DFLASH2_NUMBERS}
    weights = {k: v.to(torch.float64) for k, v in load_file(str(d / "model.safetensors")).items()}
    return cfg, weights


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on [S, heads, D]: pair dim i with i + D/2, angle pos * theta^(-2i/D)."""
    dim = x.shape[-1]
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    a, b = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def reference_conv(
    x: torch.Tensor, w: dict, name: str, source: torch.Tensor, side: int, group: int
) -> torch.Tensor:
    """One side of the convolution `name` over the block's slots x [B, H]: slot t gets
    sum_j (base_kernel[side, j] + D[t, side, j, group of the channel]) * x[t - j], where
    D = kernel_projection(source) is read as [B, 2 sides, k taps, H / group] and a tap
    before the block's first slot reads zero."""
    base = w[name + ".base_kernel"]  # [2, k, H]
    taps = base.shape[1]
    dyn = (source @ w[name + ".kernel_projection.weight"].T).view(x.shape[0], 2, taps, -1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(min(taps, t + 1)):
            coef = base[side, j] + dyn[t, side, j].repeat_interleave(group)
            out[t] = out[t] + coef * x[t - j]
    return out


def reference_draft(
    cfg: dict, w: dict, feats: torch.Tensor, block: torch.Tensor, anchor: int
) -> torch.Tensor:
    """Normed hidden states of one block [anchor, MASK...] after `anchor` context tokens."""
    eps = cfg["rms_norm_eps"]
    theta = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
    n_blk = block.shape[0]
    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    q_pos = anchor + torch.arange(n_blk)
    k_pos = torch.cat([torch.arange(anchor), q_pos])
    group = cfg["dflash2"]["conv_group_size"] if "dflash2" in cfg else 0

    def around(name: str, sublayer, x: torch.Tensor) -> torch.Tensor:
        """DFlash2: both sides of the convolution, coefficients from the sublayer's input."""
        if not group:
            return sublayer(x)
        y = sublayer(reference_conv(x, w, name, x, 0, group))
        return reference_conv(y, w, name, x, 1, group)

    h = block
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{i}."
        attn_out = around(
            p + "attention_conv",
            lambda x, i=i, kind=kind: attention(cfg, w, i, kind, x, ctx, q_pos, k_pos, theta),
            rms(h, w[p + "input_layernorm.weight"], eps),
        )
        h = h + attn_out
        y = rms(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + around(p + "mlp_conv", lambda y, p=p: mlp(w, p, y), y)
    return rms(h, w["norm.weight"], eps)


def mlp(w: dict, p: str, y: torch.Tensor) -> torch.Tensor:
    gate, up = linear(y, w, p + "mlp.gate_proj"), linear(y, w, p + "mlp.up_proj")
    return linear(torch.nn.functional.silu(gate) * up, w, p + "mlp.down_proj")


def attention(cfg: dict, w: dict, i: int, kind: str, x, ctx, q_pos, k_pos, theta):
    """Layer i's attention (o_proj included) of the block rows x over [context | block]."""
    eps, d = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_blk, p = x.shape[0], f"layers.{i}."
    q = linear(x, w, p + "self_attn.q_proj").view(n_blk, nh, d)
    q = rotate(rms(q, w[p + "self_attn.q_norm.weight"], eps), q_pos, theta)
    kv_in = torch.cat([ctx, x])  # the context is injected as keys/values in every layer
    k = linear(kv_in, w, p + "self_attn.k_proj").view(-1, nkv, d)
    k = rotate(rms(k, w[p + "self_attn.k_norm.weight"], eps), k_pos, theta)
    v = linear(kv_in, w, p + "self_attn.v_proj").view(-1, nkv, d)
    k = k.repeat_interleave(nh // nkv, dim=1)  # query head j reads KV head j // group
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    if kind == "sliding_attention":
        # HF convention: a window of W positions including the query's own; causal.
        diff = q_pos[:, None] - k_pos[None, :]
        allowed = (diff >= 0) & (diff < cfg["sliding_window"])
        scores = scores.masked_fill(~allowed, float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n_blk, nh * d)
    return linear(attn, w, p + "self_attn.o_proj")


def reference_selector(cfg: dict, w: dict, hidden: torch.Tensor, lm_head: torch.Tensor):
    """The DFlash2 selector over one block's normed hidden states [B, H]: (each drafted
    slot's candidates [B-1, K], score(s, p) = the scores [K] of slot s's candidates after
    the token p). Slot s >= 1 keeps the top-K tokens of lm_head(hidden[s]) with those
    logits as unary scores; a candidate c after the token p chosen before (the anchor for
    slot 1) scores unary(c) + sum_r predecessor_codebook[p, r] *
    (hidden_projection hidden[s])[r] * successor_codebook[c, r]."""
    top_k = cfg["dflash2"]["selector_top_k"]
    unary, cand = (hidden[1:] @ lm_head.T).topk(top_k, dim=-1)
    gate = hidden[1:] @ w["candidate_selector.hidden_projection.weight"].T
    pred = w["candidate_selector.predecessor_codebook"]
    succ = w["candidate_selector.successor_codebook"]

    def score(s: int, prev: int) -> torch.Tensor:
        return unary[s] + (pred[prev] * gate[s] * succ[cand[s]]).sum(-1)

    return cand, score


def reference_walk(
    cfg: dict, w: dict, hidden: torch.Tensor, anchor_token: int, lm_head: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """The selector's greedy path (`reference_selector`): (drafted tokens, the score rows
    it chose from [B-1, K]); the walk takes the best of each row in turn."""
    cand, score = reference_selector(cfg, w, hidden, lm_head)
    prev, tokens, rows = anchor_token, [], []
    for s in range(cand.shape[0]):
        row = score(s, prev)
        prev = int(cand[s, int(row.argmax())])
        tokens.append(prev)
        rows.append(row)
    return tokens, torch.stack(rows)


def reference_sampled_walk(
    cfg: dict,
    w: dict,
    hidden: torch.Tensor,
    anchor_token: int,
    lm_head: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The selector's sampled path: (drafted tokens, q [B-1, K], candidates [B-1, K]).
    Each slot draws from q = softmax(scores / temperature) over its K candidates, the
    scores given the token drawn before; q is what the verifier's rejection sampling
    must use, so it is returned exactly as drawn from."""
    cand, score = reference_selector(cfg, w, hidden, lm_head)
    prev, tokens, qs = anchor_token, [], []
    for s in range(cand.shape[0]):
        q = torch.softmax(score(s, prev) / temperature, dim=-1)
        prev = int(cand[s, int(torch.multinomial(q, 1, generator=generator))])
        tokens.append(prev)
        qs.append(q)
    return tokens, torch.stack(qs), cand


# ------------------------------------------------------------ the comparisons


def project_step(model: DFlashDrafter, feats, block, anchor: int) -> torch.Tensor:
    cache = model.new_cache()
    cut = anchor // 3  # extend in two pieces, as the speculative loop does
    model.extend_cache(cache, feats[:cut], torch.arange(cut))
    model.extend_cache(cache, feats[cut:anchor], torch.arange(cut, anchor))
    return model.step(cache, block, anchor)


def random_model(spec, seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # non-unit norms: a mix-up between them shows
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.mul_(8.0)  # sharper attention than std 0.02 gives, so masks matter
    return model


def inputs(spec, anchor: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(anchor, spec.num_context_features, generator=g, dtype=torch.float64)
    block = torch.randn(spec.block_size, spec.hidden_size, generator=g, dtype=torch.float64)
    return feats, block


CASES = {
    # window 3 < block 4: the window cuts both the context and the block itself
    "sliding-window-inside-block": dict(
        layers=2, block=4, layer_types=("sliding_attention", "full_attention"), window=3
    ),
    "gqa-3-to-1-wider-window": dict(
        layers=3,
        block=8,
        heads=6,
        kv_heads=2,
        head_dim=8,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        window=6,
    ),
    "all-full": dict(layers=2, block=4),
}


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reader_matches_the_project_model_on_a_float32_export(tmp_path, fmt, case):
    spec = dataclasses.replace(make_spec(**CASES[case]), rope_theta=5e5)
    model = random_model(spec, seed=1)
    save_drafter_files(tmp_path / "run", spec, model.state_dict())
    out = export_drafter(tmp_path / "run", tmp_path / "out", fmt, dtype="float32").path
    cfg, w = read_export(out)
    feats, block = inputs(spec, anchor=13)
    with torch.no_grad():
        ours = project_step(model.double().eval(), feats, block, 13)
    theirs = reference_draft(cfg, w, feats, block, 13)
    torch.testing.assert_close(theirs, ours, atol=TOL, rtol=0)


def test_reader_matches_with_attention_bias_and_the_default_bf16_export(tmp_path):
    spec = dataclasses.replace(make_spec(**CASES["gqa-3-to-1-wider-window"]), attention_bias=True)
    model = random_model(spec, seed=2)
    save_drafter_files(tmp_path / "run", spec, model.state_dict())
    out = export_drafter(tmp_path / "run", tmp_path / "out", "zlab").path  # bf16
    cfg, w = read_export(out)
    assert "layers.0.self_attn.o_proj.bias" in w
    # The project model runs the bf16-rounded weights it reads back, in float64.
    spec2, state, _ = import_drafter(out)
    loaded = DFlashDrafter(spec2).double()
    loaded.load_state_dict({k: v.double() for k, v in state.items()})
    feats, block = inputs(spec, anchor=9)
    with torch.no_grad():
        ours = project_step(loaded.eval(), feats, block, 9)
    torch.testing.assert_close(reference_draft(cfg, w, feats, block, 9), ours, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["zlab-tiny-nested", "zlab-tiny-flat"])
def test_imported_zlab_fixture_runs_as_its_config_says(tmp_path, name):
    """The hand-written configs (rope nested / flat, block size nested / top level)
    read by the reader directly and by the project's importer give one model."""
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    spec_shapes = {  # geometry from the raw config, not from the importer
        "h": cfg["hidden_size"],
        "d": cfg["head_dim"],
        "q": cfg["num_attention_heads"] * cfg["head_dim"],
        "kv": cfg["num_key_value_heads"] * cfg["head_dim"],
        "i": cfg["intermediate_size"],
        "f": len(cfg["dflash_config"]["target_layer_ids"]) * cfg["hidden_size"],
    }
    g = torch.Generator().manual_seed(0)
    s = spec_shapes
    shapes = {
        "fc.weight": (s["h"], s["f"]),
        "hidden_norm.weight": (s["h"],),
        "norm.weight": (s["h"],),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (s["q"], s["h"]),
            p + "self_attn.k_proj.weight": (s["kv"], s["h"]),
            p + "self_attn.v_proj.weight": (s["kv"], s["h"]),
            p + "self_attn.o_proj.weight": (s["h"], s["q"]),
            p + "self_attn.q_norm.weight": (s["d"],),
            p + "self_attn.k_norm.weight": (s["d"],),
            p + "mlp.gate_proj.weight": (s["i"], s["h"]),
            p + "mlp.up_proj.weight": (s["i"], s["h"]),
            p + "mlp.down_proj.weight": (s["h"], s["i"]),
            p + "input_layernorm.weight": (s["h"],),
            p + "post_attention_layernorm.weight": (s["h"],),
        }
    tensors = {
        k: (torch.randn(sh, generator=g) * 0.3).to(torch.bfloat16) for k, sh in shapes.items()
    }
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "model.safetensors"))
    spec, state, _ = import_drafter(d)
    model = DFlashDrafter(spec).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    feats, block = inputs(spec, anchor=10)
    ref_cfg, w = read_export(d)
    with torch.no_grad():
        ours = project_step(model.eval(), feats, block, 10)
    torch.testing.assert_close(
        reference_draft(ref_cfg, w, feats, block, 10), ours, atol=TOL, rtol=0
    )


@pytest.mark.parametrize(
    "mistake",
    ["rope_theta", "window_off_by_one", "norms_swapped", "tapped_layers_reordered"],
)
def test_the_comparison_catches_format_mistakes(tmp_path, mistake):
    """Each of these mistakes moves the output far beyond TOL, so the parity tests
    above would fail on it (they are not vacuous at their tolerance)."""
    spec = make_spec(**CASES["sliding-window-inside-block"])
    model = random_model(spec, seed=1)
    save_drafter_files(tmp_path / "run", spec, model.state_dict())
    out = export_drafter(tmp_path / "run", tmp_path / "out", "zlab", dtype="float32").path
    cfg, w = read_export(out)
    feats, block = inputs(spec, anchor=13)
    ref_feats = feats
    if mistake == "rope_theta":
        cfg["rope_parameters"]["rope_theta"] *= 1.01
    elif mistake == "window_off_by_one":
        cfg["sliding_window"] += 1
    elif mistake == "norms_swapped":
        p = "layers.0.self_attn."
        w[p + "q_norm.weight"], w[p + "k_norm.weight"] = (
            w[p + "k_norm.weight"],
            w[p + "q_norm.weight"],
        )
    else:  # features concatenated in another layer order than fc was trained on
        ref_feats = torch.cat(feats.chunk(len(spec.target_layer_ids), dim=-1)[::-1], dim=-1)
    with torch.no_grad():
        ours = project_step(model.double().eval(), feats, block, 13)
    diff = (reference_draft(cfg, w, ref_feats, block, 13) - ours).abs().max().item()
    assert diff > 100 * TOL, diff
