"""DFlash2 in the engine layouts: export, import, `export --check`, the model card, and
drafting parity with the independent reader of tests/test_export_reader.py (its
`reference_draft` runs the convolutions, `reference_walk` walks the selector and
`reference_sampled_walk` samples its walk; none shares code with the model class).

tests/fixtures/zlab-tiny-dflash2 is the published z-lab DFlash2 checkpoint scaled down:
config.json has the published field set (hidden 64, 2 layers, vocab 97, full_attention
layers), safetensors-header.json the published tensor names with each published
dimension replaced by the tiny one; `fixture_dir` fills it with random weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import make_spec
from safetensors.torch import load_file, save_file
from test_export_reader import (
    inputs,
    project_step,
    random_model,
    read_export,
    reference_draft,
    reference_sampled_walk,
    reference_walk,
)

from dflash_trainer.cli import main
from dflash_trainer.core.dflash2 import walk_greedy
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.check import check_export
from dflash_trainer.formats.drafter_io import load_drafter, save_drafter_files
from dflash_trainer.formats.export import export_drafter, import_drafter, target_info

FIXTURE = Path(__file__).parent / "fixtures" / "zlab-tiny-dflash2"
WEIGHTS = "model.safetensors"
D2 = dict(kind="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8)
# The reader is float64; our model normalises (RMSNorm) and computes RoPE angles in
# float32 even in float64, ~1e-7 relative per op. The convolutions around every
# sublayer lengthen that chain: run in float64 throughout, the two agree to 1e-14 on
# the fixture; as they are, to ~5e-6 on outputs of magnitude ~5. A format mistake moves
# them by far more (test_the_dflash2_comparison_catches_format_mistakes).
TOL = 2e-5


def dflash2_spec(**kw):
    kw = {"block": 8, "layers": 2, "selector_top_k": 16, **D2, **kw}
    return make_spec(**kw)


def random_dflash2(spec, seed: int) -> DFlashDrafter:
    """Random backbone (as the DFlash reader tests) and non-trivial DFlash2 modules."""
    model = random_model(spec, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
                p[:, 0] += 1.0
            elif "kernel_projection" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.startswith("candidate_selector."):
                scale = 0.3 if "hidden_projection" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def project_walk(model: DFlashDrafter, hidden, anchor_token: int, lm_head) -> list[int]:
    """Our model's greedy walk: `lattice` + `walk_greedy` over the top-K of
    lm_head(hidden[1:]), the drafted tokens being cand[s, pick[s]]."""
    selector = model.candidate_selector
    assert selector is not None
    unary, cand = (hidden[1:] @ lm_head.T).topk(model.spec.selector_top_k, dim=-1)
    lattice = selector.lattice(hidden[1:], torch.tensor(anchor_token), cand, unary)
    pick = walk_greedy(lattice)
    return cand[torch.arange(cand.shape[0]), pick].tolist()


def write_run(tmp: Path, spec, model: DFlashDrafter, meta=None) -> Path:
    save_drafter_files(tmp / "run", spec, model.state_dict(), meta or {})
    return tmp / "run"


def edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d: Path, fn) -> None:
    tensors = load_file(str(d / WEIGHTS))
    fn(tensors)
    save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})


def fixture_dir(tmp: Path, edit=None, seed: int = 0) -> Path:
    """The scaled published checkpoint: its config, random bf16 weights of its header."""
    cfg = json.loads((FIXTURE / "config.json").read_text())
    header = json.loads((FIXTURE / "safetensors-header.json").read_text())
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, entry in header.items():
        assert entry["dtype"] == "BF16"
        t = torch.randn(entry["shape"], generator=g)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.2 * t
        elif name.endswith("base_kernel"):
            t = 0.5 * t
            t[:, 0] += 1.0
        elif not name.endswith("codebook"):  # matrices: outputs of unit scale, and sharper
            t = t * 2.0 / entry["shape"][-1] ** 0.5
        tensors[name] = t.to(torch.bfloat16)
    d = tmp / "zlab-tiny-dflash2"
    d.mkdir()
    save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})
    if edit:
        edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def drafts_alike(
    model: DFlashDrafter, export_dir: Path, anchor: int, seed: int
) -> tuple[list[int], list[int]]:
    """Our model (float64) and the reader over the export's files: the same hidden
    states to TOL and the same drafted tokens. Returns (the drafted tokens, each slot's
    argmax), so a test can see that the selector changed the path."""
    spec = model.spec
    cfg, w = read_export(export_dir)
    feats, block = inputs(spec, anchor=anchor, seed=seed)
    lm_head = torch.randn(
        spec.vocab_size,
        spec.hidden_size,
        generator=torch.Generator().manual_seed(seed),
        dtype=torch.float64,
    )
    anchor_token = seed % spec.vocab_size
    with torch.no_grad():
        ours = project_step(model.double().eval(), feats, block, anchor)
        ours_tokens = project_walk(model, ours, anchor_token, lm_head)
    theirs = reference_draft(cfg, w, feats, block, anchor)
    torch.testing.assert_close(theirs, ours, atol=TOL, rtol=0)
    tokens, _ = reference_walk(cfg, w, theirs, anchor_token, lm_head)
    assert tokens == ours_tokens
    sampled_q_alike(model, cfg, w, theirs, anchor_token, lm_head, seed)
    return tokens, (theirs[1:] @ lm_head.T).argmax(-1).tolist()


def sampled_q_alike(model: DFlashDrafter, cfg, w, hidden, anchor_token: int, lm_head, seed):
    """The reader's sampled walk (t = 0.7) returns, along the path it drew, the q rows our
    selector's lattice gives for that path: q_s = softmax(lattice[s, previous pick] / t)."""
    selector = model.candidate_selector
    assert selector is not None
    g = torch.Generator().manual_seed(seed)
    tokens, q, cand = reference_sampled_walk(cfg, w, hidden, anchor_token, lm_head, 0.7, g)
    unary, ours_cand = (hidden[1:] @ lm_head.T).topk(model.spec.selector_top_k, dim=-1)
    assert torch.equal(cand, ours_cand)
    with torch.no_grad():
        lattice = selector.lattice(hidden[1:], torch.tensor(anchor_token), cand, unary)
    picks = [cand[s].tolist().index(t) for s, t in enumerate(tokens)]
    rows = [lattice[s, picks[s - 1] if s else 0] for s in range(len(picks))]
    ours_q = torch.softmax(torch.stack(rows) / 0.7, dim=-1)
    torch.testing.assert_close(q, ours_q, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ export: the layouts


def test_zlab_export_writes_the_published_dflash2_config_and_tensor_names(tmp_path):
    spec = dflash2_spec(block=8)
    model = random_dflash2(spec, seed=0)
    out = export_drafter(write_run(tmp_path, spec, model), tmp_path / "out", "zlab").path
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["is_causal"] is False
    assert cfg["dflash_config"] == {
        "block_size": 8,
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": [1, 3, 5],
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 16,
    }
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["use_sliding_window"] is False
    stored = load_file(str(out / WEIGHTS))
    # The published names (the fixture header is the published list for 2 layers); the
    # backbone's shapes differ from the fixture's, the DFlash2 ones follow the rule.
    header = json.loads((FIXTURE / "safetensors-header.json").read_text())
    assert set(stored) == set(header)
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert stored["layers.1.mlp_conv.base_kernel"].shape == (2, 2, 64)
    assert stored["layers.0.attention_conv.kernel_projection.weight"].shape == (2 * 2 * 4, 64)
    assert stored["candidate_selector.hidden_projection.weight"].shape == (8, 64)
    assert stored["candidate_selector.predecessor_codebook"].shape == (97, 8)
    assert "candidate_selector.successor_codebook.weight" not in stored
    for name, t in model.state_dict().items():
        assert torch.equal(stored[name], t.to(torch.bfloat16)), name


def test_speculators_export_writes_the_dflash2_model_type_and_fields(tmp_path):
    spec = dflash2_spec()
    meta = {"target": {"name_or_path": "org/tiny-target"}}
    run = write_run(tmp_path, spec, random_dflash2(spec, 0), meta)
    cfg = json.loads(
        (export_drafter(run, tmp_path / "s", "speculators").path / "config.json").read_text()
    )
    assert cfg["speculators_model_type"] == "dflash2"
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["speculators_config"]["algorithm"] == "dflash2"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    fields = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    assert {k: cfg[k] for k in fields} == {k: getattr(spec, k) for k in fields}
    assert cfg["draft_vocab_size"] == cfg["transformer_layer_config"]["vocab_size"] == 97
    assert cfg["sample_from_anchor"] is False
    assert cfg["sliding_window_non_causal"] is True


def test_a_dflash_export_carries_nothing_of_dflash2(tmp_path):
    spec = make_spec(layers=2)
    out = export_drafter(write_run(tmp_path, spec, DFlashDrafter(spec)), tmp_path / "o", "zlab")
    cfg = json.loads((out.path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "is_causal" not in cfg
    assert set(cfg["dflash_config"]) == {"block_size", "mask_token_id", "target_layer_ids"}


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_dflash2_export_of_a_drafter_with_sliding_layers_is_refused(tmp_path, fmt):
    spec = dflash2_spec(layer_types=("sliding_attention", "full_attention"), window=3)
    run = write_run(tmp_path, spec, random_dflash2(spec, 0))
    with pytest.raises(DFlashError, match=r"layers \[0\] are sliding_attention.*full_attention"):
        export_drafter(run, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_round_trip_gives_the_same_spec_tensors_and_drafts(tmp_path, fmt):
    spec = dflash2_spec(conv_kernel_size=3, block=6, selector_top_k=5)
    model = random_dflash2(spec, seed=3)
    out = export_drafter(write_run(tmp_path, spec, model), tmp_path / fmt, fmt, dtype="float32")
    assert out.report.ok, out.report.render()
    spec2, state2, _ = import_drafter(out.path)
    assert spec2 == spec
    assert state2.keys() == model.state_dict().keys()
    assert all(torch.equal(state2[k], v) for k, v in model.state_dict().items())


def test_export_of_an_export_converts_dflash2_layouts(tmp_path):
    spec = dflash2_spec()
    run = write_run(tmp_path, spec, random_dflash2(spec, 1))
    z = export_drafter(run, tmp_path / "z", "zlab").path
    s = export_drafter(z, tmp_path / "s", "speculators").path
    z2 = export_drafter(s, tmp_path / "z2", "zlab").path
    assert (z / "config.json").read_text() == (z2 / "config.json").read_text()
    a, b = load_file(str(z / WEIGHTS)), load_file(str(z2 / WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ the independent reader

READER_CASES = {
    "k2-block8": dict(block=8),
    "k3-block6-top5": dict(conv_kernel_size=3, block=6, selector_top_k=5),
    "gqa-group8": dict(heads=6, kv_heads=2, head_dim=8, conv_group_size=8, block=5),
}


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
@pytest.mark.parametrize("case", sorted(READER_CASES))
def test_reader_drafts_what_our_model_drafts(tmp_path, fmt, case):
    spec = dataclasses.replace(dflash2_spec(**READER_CASES[case]), rope_theta=5e5)
    model = random_dflash2(spec, seed=1)
    out = export_drafter(write_run(tmp_path, spec, model), tmp_path / "o", fmt, dtype="float32")
    walks = [drafts_alike(model, out.path, anchor, seed) for anchor, seed in ((13, 7), (4, 8))]
    # The selector moved a path off the argmax: the comparison is not vacuous.
    assert any(tokens != argmax for tokens, argmax in walks)


@pytest.mark.parametrize("mistake", ["taps_reversed", "sides_swapped", "codebooks_swapped"])
def test_the_dflash2_comparison_catches_format_mistakes(tmp_path, mistake):
    spec = dflash2_spec()
    model = random_dflash2(spec, seed=1)
    out = export_drafter(write_run(tmp_path, spec, model), tmp_path / "o", "zlab", dtype="float32")
    cfg, w = read_export(out.path)
    feats, block = inputs(spec, anchor=13)
    with torch.no_grad():
        ours = project_step(model.double().eval(), feats, block, 13)
    lm_head = torch.randn(97, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _, rows = reference_walk(cfg, w, ours, 3, lm_head)
    for i in range(spec.num_layers):
        base = f"layers.{i}.attention_conv.base_kernel"
        if mistake == "taps_reversed":
            w[base] = w[base].flip(1)
        elif mistake == "sides_swapped":
            w[base] = w[base].flip(0)
    if mistake == "codebooks_swapped":
        a, b = "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"
        w[a], w[b] = w[b], w[a]
        _, rows2 = reference_walk(cfg, w, ours, 3, lm_head)
        assert (rows2 - rows).abs().max().item() > 1e-3
    else:
        diff = (reference_draft(cfg, w, feats, block, 13) - ours).abs().max().item()
        assert diff > 100 * TOL, diff


# ------------------------------------------------------------------ the published fixture


def test_scaled_published_checkpoint_imports_checks_and_drafts_alike(tmp_path, capsys):
    d = fixture_dir(tmp_path)
    assert main(["export", "--check", str(d)]) == 0, capsys.readouterr().out
    assert main(["import", str(d), "--out", str(tmp_path / "ours")]) == 0
    assert "zlab layout, DFlash2 drafter, 2 layers" in capsys.readouterr().out
    spec, state, meta = load_drafter(tmp_path / "ours")
    assert (spec.kind, spec.block_size, spec.conv_kernel_size, spec.conv_group_size) == (
        "dflash2",
        8,
        2,
        16,
    )
    assert (spec.selector_rank, spec.selector_top_k, spec.rope_theta) == (8, 16, 5e5)
    assert meta["import_warnings"] == []
    model = DFlashDrafter(spec).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    for anchor, seed in ((10, 1), (3, 2)):
        tokens, argmax = drafts_alike(model, d, anchor, seed)
        assert tokens != argmax
    # Re-exported: the same tensors, and every published field the export carries.
    res = export_drafter(tmp_path / "ours", tmp_path / "re", "zlab")
    assert res.report.ok, res.report.render()
    before, after = load_file(str(d / WEIGHTS)), load_file(str(res.path / WEIGHTS))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    src, re = (json.loads((p / "config.json").read_text()) for p in (d, res.path))
    not_carried = {
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "transformers_version",
        "use_cache",
    }
    for key in set(src) - not_carried - {"dflash_config"}:
        assert re[key] == src[key], key
    neutral = {"output_multiplier", "final_logit_softcapping"}  # the default, not written
    assert {k: v for k, v in src["dflash_config"].items() if k not in neutral} == re[
        "dflash_config"
    ]


def test_codebooks_saved_with_a_weight_suffix_import_under_the_bare_names(tmp_path):
    d = fixture_dir(tmp_path)
    names = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
    edit_tensors(d, lambda t: t.update({n + ".weight": t.pop(n) for n in names}))
    with pytest.warns(UserWarning, match=r"as the published bare names"):
        _, state, _ = import_drafter(d)
    assert all(n in state and n + ".weight" not in state for n in names)
    report = check_export(d)  # engines other than the z-lab reference want the bare names
    failed = {p.field: p.fix for p in report.problems if p.severity == "error"}
    assert failed[names[0] + ".weight"].startswith(f"store it as {names[0]}")
    edit_tensors(d, lambda t: t.update({names[0]: t[names[0] + ".weight"].clone()}))
    with pytest.raises(DFlashError, match="both"):
        import_drafter(d)


def sliding(cfg: dict) -> None:
    """The published layer kinds (all sliding, window 2048)."""
    cfg.update(layer_types=["sliding_attention"] * 2, sliding_window=2048, use_sliding_window=True)


def sliding_no_flag(cfg: dict) -> None:
    sliding(cfg)
    del cfg["is_causal"]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (sliding, "bidirectionally"),
        (sliding_no_flag, "depending on the engine"),
        (lambda c: c.update(is_causal=True), "is_causal=true"),
        (lambda c: c["dflash_config"].update(output_multiplier=0.196), "output_multiplier"),
        (lambda c: c["dflash_config"].update(final_logit_softcapping=20.0), "softcapping"),
        (lambda c: c["dflash_config"].update(input_embedding_scale=2.0), "input_embedding"),
        (lambda c: c.update(output_multiplier=0.5), "output_multiplier"),
        (lambda c: c.update(architectures=["DSparkDraftModel"]), "another model"),
        (lambda c: c.update(architectures=["DFlashDraftModel", "DFlash2DraftModel"]), "exactly"),
        (lambda c: c["dflash_config"].pop("selector_rank"), "selector_rank: missing"),
        (lambda c: c["dflash_config"].update(conv_group_size=24), "does not divide"),
        (lambda c: c["dflash_config"].update(conv_kernel_size=9), "exceeds block_size"),
        (lambda c: c["dflash_config"].update(selector_top_k=98), "exceeds the vocabulary"),
        (lambda c: c["dflash_config"].update(selector_top_k=0), "selector_top_k"),
        (lambda c: c["dflash_config"].update(conv_kernel_size="2"), "conv_kernel_size"),
        (lambda c: c.update(architectures=["DFlashDraftModel"]), "is a DFlash2 field"),
    ],
)
def test_dflash2_configs_we_would_serve_wrong_are_refused(tmp_path, edit, match):
    d = fixture_dir(tmp_path, edit=edit)
    with pytest.raises(DFlashError, match=match):
        import_drafter(d)


def test_a_dflash2_config_over_dflash_weights_is_refused(tmp_path):
    d = fixture_dir(tmp_path)
    edit_tensors(d, lambda t: [t.pop(k) for k in list(t) if "_conv." in k or "selector" in k])
    with pytest.raises(DFlashError, match="weights are a DFlash drafter's"):
        import_drafter(d)
    report = check_export(d)
    assert "architectures" in {p.field for p in report.problems if p.severity == "error"}
    assert not any("missing" in p.message for p in report.problems)  # one error, not 14


def test_speculators_dflash2_sliding_layers_import_only_when_trained_causal(tmp_path):
    spec = dflash2_spec()
    run = write_run(tmp_path, spec, random_dflash2(spec, 0))
    out = export_drafter(run, tmp_path / "s", "speculators").path

    def slide(cfg: dict) -> None:
        for where in (cfg, cfg["transformer_layer_config"]):
            where.update(layer_types=["sliding_attention", "full_attention"])
            where.update(sliding_window=4, use_sliding_window=True, max_window_layers=0)
        del cfg["sliding_window_non_causal"]  # speculators' DFlash2 default: true

    edit_config(out, slide)
    with pytest.raises(DFlashError, match="speculators' DFlash2 default"):
        import_drafter(out)
    edit_config(out, lambda c: c.update(sliding_window_non_causal=False))
    spec2, _, _ = import_drafter(out)  # trained causal by speculators, as ours
    assert spec2.layer_types == ("sliding_attention", "full_attention") and spec2.is_dflash2
    assert "layer_types" in failed(out)  # no DFlash2 engine layout can say so
    with pytest.raises(DFlashError, match="sliding_attention"):
        export_drafter(out, tmp_path / "z", "zlab")


def test_a_dflash_config_with_is_causal_and_sliding_layers_is_refused(tmp_path):
    spec = make_spec(layers=2, layer_types=("sliding_attention", "full_attention"), window=3)
    out = export_drafter(write_run(tmp_path, spec, DFlashDrafter(spec)), tmp_path / "o", "zlab")
    edit_config(out.path, lambda c: c.update(is_causal=False))
    with pytest.raises(DFlashError, match="engines run them bidirectionally"):
        import_drafter(out.path)
    assert "is_causal" in {p.field for p in check_export(out.path).problems}


# ------------------------------------------------------------------ export --check


def write_target(d: Path, vocab: int = 97) -> Path:
    d.mkdir(parents=True)
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "eos_token_id": 2,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def exported(tmp_path):
    def make(fmt: str) -> Path:
        spec = dflash2_spec()
        run = write_run(tmp_path, spec, random_dflash2(spec, 0))
        return export_drafter(run, tmp_path / fmt, fmt).path

    return make


def failed(d: Path, target: Path | None = None) -> set[str]:
    t_cfg, special = target_info(str(target)) if target else (None, set())
    report = check_export(d, t_cfg, special)
    assert all(p.fix for p in report.problems)
    return {p.field for p in report.problems if p.severity == "error"}


ZLAB_BREAKS = [
    (lambda c: c.pop("is_causal"), "is_causal"),
    (lambda c: c.update(is_causal=True), "is_causal"),
    (lambda c: c["dflash_config"].pop("conv_group_size"), "dflash_config.conv_group_size"),
    (lambda c: c["dflash_config"].update(conv_group_size=24), "dflash_config.conv_group_size"),
    (lambda c: c["dflash_config"].update(conv_kernel_size=9), "dflash_config.conv_kernel_size"),
    (lambda c: c["dflash_config"].update(selector_top_k=98), "dflash_config.selector_top_k"),
    (lambda c: c["dflash_config"].update(selector_top_k=0), "dflash_config.selector_top_k"),
    (lambda c: c["dflash_config"].update(selector_rank="8"), "dflash_config.selector_rank"),
    (lambda c: c["dflash_config"].update(output_multiplier=2.0), "dflash_config.output_multiplier"),
    (lambda c: c.update(input_embedding_scale=2.0), "input_embedding_scale"),
    (lambda c: c.update(architectures=["DFlashDraftModel"]), "architectures"),
    (lambda c: c.update(architectures=["DFlash3DraftModel"]), "architectures"),
    (
        lambda c: c.update(
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
            use_sliding_window=True,
            max_window_layers=0,
        ),
        "layer_types",
    ),
]


@pytest.mark.parametrize(("edit", "field"), ZLAB_BREAKS)
def test_each_dflash2_config_mistake_is_reported(exported, edit, field):
    d = exported("zlab")
    assert failed(d) == set()
    edit_config(d, edit)
    assert field in failed(d)


SPECULATORS_BREAKS = [
    (lambda c: c.update(speculators_model_type="dflash"), "architectures"),
    (lambda c: c["speculators_config"].update(algorithm="dflash"), "speculators_config.algorithm"),
    (lambda c: c.pop("sliding_window_non_causal"), "sliding_window_non_causal"),
    (lambda c: c.update(selector_top_k=500), "selector_top_k"),
    (lambda c: c.pop("conv_kernel_size"), "conv_kernel_size"),
    (lambda c: c.update(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (lambda c: c.update(draft_vocab_size=50), "draft_vocab_size"),
]


@pytest.mark.parametrize(("edit", "field"), SPECULATORS_BREAKS)
def test_each_dflash2_speculators_mistake_is_reported(exported, edit, field):
    d = exported("speculators")
    assert failed(d) == set()
    edit_config(d, edit)
    assert field in failed(d)


TENSOR_BREAKS = [
    (
        lambda t: t.pop("candidate_selector.successor_codebook"),
        "candidate_selector.successor_codebook",
    ),
    (
        lambda t: t.update({"layers.0.mlp_conv.base_kernel": torch.ones(2, 3, 64)}),
        "layers.0.mlp_conv.base_kernel",
    ),
    (
        lambda t: t.update(
            {"layers.1.attention_conv.kernel_projection.weight": torch.zeros(64, 16)}
        ),
        "layers.1.attention_conv.kernel_projection.weight",
    ),
    (
        lambda t: t.update({"candidate_selector.predecessor_codebook": torch.zeros(96, 8)}),
        "candidate_selector.predecessor_codebook",
    ),
    (
        lambda t: t["candidate_selector.hidden_projection.weight"].__setitem__(0, float("nan")),
        "candidate_selector.hidden_projection.weight",
    ),
]


@pytest.mark.parametrize(("edit", "field"), TENSOR_BREAKS)
def test_each_dflash2_tensor_mistake_is_reported(exported, edit, field):
    d = exported("zlab")
    edit_tensors(d, edit)
    assert field in failed(d)


def test_the_vocabulary_must_be_the_targets(exported, tmp_path):
    d = exported("zlab")
    assert failed(d, write_target(tmp_path / "t")) == set()
    assert "vocab_size" in failed(d, write_target(tmp_path / "t2", vocab=128))


def test_a_dflash_config_over_dflash2_weights_is_one_clear_failure(exported):
    d = exported("zlab")
    edit_config(d, lambda c: c.update(architectures=["DFlashDraftModel"]))
    report = check_export(d)
    errors = {p.field: p.message for p in report.problems if p.severity == "error"}
    assert "hold DFlash2 modules" in errors["architectures"]
    assert "a DFlash2 field" in errors["dflash_config.conv_kernel_size"]
    assert not [f for f in errors if f.startswith(("layers.", "candidate_selector."))]


# ------------------------------------------------------------------ the model card


def test_card_and_commands_name_dflash2_and_its_serve_commands(tmp_path, capsys):
    spec = dflash2_spec()
    run = write_run(tmp_path, spec, random_dflash2(spec, 0), {"target": {"name_or_path": "o/t"}})
    out = tmp_path / "out"
    assert main(["export", str(run), "--to", "zlab", str(out)]) == 0
    printed = capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert "# DFlash2 drafter for o/t" in card and "- dflash2" in card
    assert "conv_kernel_size 2, conv_group_size 16 (4 groups" in card
    assert "selector_rank 8, selector_top_k 16" in card and "vLLM >= 0.28" in card
    for text in (card, printed):
        assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve o/t" in text
        assert '"method": "dflash"' in text and '"num_speculative_tokens": 7' in text
        assert "--speculative-algorithm DFLASH" in text
        assert "--speculative-num-draft-tokens 8" in text
        assert "from dflash.model import DFlash2DraftModel" in text
