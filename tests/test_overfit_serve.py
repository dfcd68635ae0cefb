"""Overfit-then-serve gate: a drafter that memorized one document must draft it whole.

One short conversation is answered by a tiny real target (greedy, as regeneration would),
the answer becomes a one-document prepared dataset, and the real Trainer trains a drafter on
it until it has memorized the answer. Serving that conversation's prompt at temperature 0,
every verify step should then accept (nearly) the whole block: tau close to the block size.

The gate runs the served side three ways:
- `evaluate_prompts`, the loop `dflash eval` and in-training evals run, on the trained model;
- `dflash eval` on a bf16 z-lab export of the run (the importer reads it back), and on the
  run's drafter files copied out of the run directory;
- the speculative loop driving the independent reader of test_export_reader.py, which
  drafts from a float32 `dflash export --to zlab` of the run (config.json +
  model.safetensors) with plain torch ops.
A DFlash2 drafter (its own fixture, `trained2`) goes through the same three, at t=0 (the
selector's greedy walk) and at t=1 (its sampled walk, verified by rejection sampling with
the q it was drawn from: the project's, or the reader's own), over a target made confident
enough that its t=1 answer is the memorized one (`make_confident`).
Any disagreement between the training forward (masks, positions, tapped features, labels)
and what serving computes shows up as tau near 1. The broken variants at the end perturb
one thing at serve time and check that the gate then fails.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_export_reader import (
    read_export,
    reference_draft,
    reference_sampled_walk,
    reference_walk,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from trainer_utils import VOCAB, write_tiny_target
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from dflash_trainer.cli import main
from dflash_trainer.config import EvalConfig, config_from_dict
from dflash_trainer.data.shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST, ShardWriter
from dflash_trainer.eval.drafting import Proposal
from dflash_trainer.eval.evaluate import evaluate_prompts
from dflash_trainer.eval.prompt_run import render_prompt, stop_token_ids
from dflash_trainer.eval.speculative import DFlashBlockDrafter, generate
from dflash_trainer.formats.drafter_io import build_drafter
from dflash_trainer.formats.export import export_drafter
from dflash_trainer.target.model import FrozenTarget
from dflash_trainer.train.trainer import Trainer

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

BLOCK = 8
LAYER_IDS = [1, 2]
MASK_ID = VOCAB - 1
NEW_TOKENS = 1 + 6 * BLOCK  # the prefill's token, then six full blocks when all is accepted
GATE = 0.9 * BLOCK
# tau reaches 8.0 from ~150 steps on (100 steps: 6.5, 60: 3.5); 200 leaves a margin.
STEPS = 200


# ----------------------------------------------------------------------------- the document


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the tiny target's 64 ids, with a chat template."""
    words = ["[UNK]", "<|end|>", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(60)]
    assert len(words) == VOCAB
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="[UNK]",
        eos_token="<|end|>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    tok.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    return tok


def pick_document(target: FrozenTarget, tok: Any) -> tuple[list[dict[str, str]], list[int]]:
    """A conversation whose greedy answer (NEW_TOKENS + a block) has no stop or mask id.

    The answer is the target's own greedy continuation, so at temperature 0 the target's
    argmax accepts exactly these tokens; stop ids would end the response early.
    """
    bad = set(stop_token_ids(tok, target.model)) | {MASK_ID}
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        words = torch.randint(0, 58, (6,), generator=g).tolist()
        messages = [{"role": "user", "content": " ".join(f"w{i}" for i in words)}]
        ids = render_prompt(tok, messages, enable_thinking=False)
        answer = generate(target, ids, max_new_tokens=NEW_TOKENS + BLOCK).tokens
        if not bad.intersection(answer):
            return messages, ids + answer
    raise AssertionError("no candidate prompt gives an answer free of stop/mask ids")


def write_one_document(path: Path, ids: list[int], prompt_len: int) -> Path:
    """A prepared dataset of one document: the prompt unsupervised, the answer supervised."""
    w = ShardWriter(path, "train", shard_tokens=4096)
    mask = np.zeros(len(ids), dtype=bool)
    mask[prompt_len:] = True
    w.add("doc0", np.asarray(ids, dtype=np.int32), mask)
    entries = w.close()
    split = {
        "documents": 1,
        "tokens": len(ids),
        "supervised_tokens": int(mask.sum()),
        "shards": entries,
    }
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "splits": {"train": split}}
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def train_config(
    tmp: Path, target: Path, data: Path, steps: int, drafter: dict[str, Any] | None = None
) -> Any:
    cfg = _config_dict(tmp, target, data, steps)
    cfg["drafter"].update(drafter or {})
    return config_from_dict(cfg)


def _config_dict(tmp: Path, target: Path, data: Path, steps: int) -> dict[str, Any]:
    return {
        "target": {"name_or_path": str(target), "dtype": "float32"},
        "drafter": {
            "num_layers": 2,
            "block_size": BLOCK,
            "target_layer_ids": LAYER_IDS,
            "mask_token_id": MASK_ID,
            "geometry": None,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            # window 6 < block 8: the window cuts inside the block, so a window
            # applied differently in training and serving would show
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 6,
        },
        "data": {"train": str(data), "token_budget": 128},
        "training": {
            "max_steps": steps,
            "lr": 3e-3,
            "warmup_ratio": 0.0,
            "max_anchors": 64,
            "log_every": 50,
            "checkpoint_every": 10_000,
            "compile": False,
            "precision": "fp32",
            "device": "cpu",
        },
        "run": {"output_dir": str(tmp / "run")},
    }


CONFIDENCE = 2.0**10


def make_confident(target_dir: Path) -> None:
    """Scale the target's final norm by CONFIDENCE: its logits scale by it exactly (a power
    of two), so its greedy answer, tapped features and argmax labels, and with them the
    trained drafter, stay bit for bit what they were, while its temperature-1 samples follow
    the greedy answer (this target's smallest top-2 margin along the answer, ~0.01, becomes
    ~10 nats), as a trained LM's do on an answer it is sure of. Only then can a drafter
    that memorized the greedy answer be accepted at t=1."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(CONFIDENCE)
    model.save_pretrained(target_dir)


@dataclasses.dataclass
class Trained:
    tmp: Path
    target_dir: Path
    target: FrozenTarget
    tokenizer: Any
    messages: list[dict[str, str]]
    prompt_ids: list[int]
    answer: list[int]
    """The target's greedy answer to the prompt (NEW_TOKENS), which the drafter memorized."""
    run_dir: Path
    train_s: float


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend (see one_thread)
    try:
        return _train(tmp_path_factory.mktemp("overfit"))
    finally:
        torch.set_num_threads(before)


def _train(tmp: Path, drafter: dict[str, Any] | None = None, confident: bool = False) -> Trained:
    target_dir = write_tiny_target(tmp / "target")
    if confident:
        make_confident(target_dir)
    tok = word_tokenizer()
    tok.save_pretrained(target_dir)  # `dflash eval --target DIR` loads it from there
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target = FrozenTarget(model, LAYER_IDS)
    messages, doc = pick_document(target, tok)
    prompt_len = len(render_prompt(tok, messages, enable_thinking=False))
    data = write_one_document(tmp / "data", doc, prompt_len)
    cfg = train_config(tmp, target_dir, data, steps=STEPS, drafter=drafter)
    t0 = time.perf_counter()
    Trainer(cfg, log_to_console=False).train()
    train_s = time.perf_counter() - t0
    answer = doc[prompt_len : prompt_len + NEW_TOKENS]
    return Trained(
        tmp, target_dir, target, tok, messages, doc[:prompt_len], answer, tmp / "run", train_s
    )


# ----------------------------------------------------------------------------- serving


GREEDY = EvalConfig(max_new_tokens=NEW_TOKENS, temperature=0.0)


def test_eval_loop_accepts_the_memorized_answer(trained: Trained) -> None:
    drafter, _ = build_drafter(trained.run_dir)
    res = evaluate_prompts(
        drafter, trained.target, trained.tokenizer, [trained.messages], GREEDY, baseline=True
    )
    print(f"train {trained.train_s:.1f} s; eval loop tau {res['tau']:.3f}")
    assert res["lossless_mismatches"] == 0
    assert res["responses"][0]["new_tokens"] == NEW_TOKENS
    assert res["tau"] >= GATE, res["responses"][0]["accepted"]


def test_dflash_eval_on_a_zlab_export_accepts_the_memorized_answer(trained: Trained) -> None:
    # bfloat16, the default: what a published export serves
    out = export_drafter(trained.run_dir, trained.tmp / "zlab", "zlab").path
    prompts = trained.tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": trained.messages}) + "\n")
    report = trained.tmp / "zlab_eval.json"
    argv = ["eval", "--drafter", str(out), "--target", str(trained.target_dir)]
    argv += ["--prompts", str(prompts), "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"]
    argv += ["--no-progress", "--json", str(report)]
    assert main(argv) == 0
    res = next(iter(json.loads(report.read_text())["sets"].values()))
    print(f"dflash eval (z-lab export) tau {res['tau']:.3f}")
    assert res["lossless_mismatches"] == 0
    assert res["tau"] >= GATE, res["responses"][0]["accepted"]


def test_dflash_eval_on_a_standalone_drafter_directory(trained: Trained) -> None:
    """The project's own files copied out of the run: `dflash eval --drafter DIR` reads them
    and finds the target they record, with no run directory around."""
    standalone = trained.tmp / "published" / "tiny-dflash-b8"
    shutil.copytree(trained.run_dir / "drafter", standalone)
    prompts = trained.tmp / "prompts_own.jsonl"
    prompts.write_text(json.dumps({"messages": trained.messages}) + "\n")
    report = trained.tmp / "own_eval.json"
    argv = ["eval", "--drafter", str(standalone), "--prompts", str(prompts), "--device", "cpu"]
    argv += ["--max-new-tokens", str(NEW_TOKENS), "--no-progress", "--json", str(report)]
    assert main(argv) == 0
    res = next(iter(json.loads(report.read_text())["sets"].values()))
    print(f"dflash eval (standalone drafter dir) tau {res['tau']:.3f}")
    assert res["tau"] >= GATE, res["responses"][0]["accepted"]


class ReaderDrafter:
    """A BlockDrafter over the independent reader: plain torch ops on the exported files,
    the whole context recomputed every step (no cache to get wrong). A DFlash2 export's
    drafts are the reader's selector walk: greedy at temperature 0, else sampled and
    returned with the reader's own q (the loop verifies them by rejection sampling)."""

    needs_features = True

    def __init__(
        self,
        export_dir: Path,
        target: FrozenTarget,
        feature_order: list[int],
        edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
    ):
        self.cfg, self.w = read_export(export_dir)
        if edit is not None:
            edit(self.w)
        self.block_size = int(self.cfg["dflash_config"]["block_size"])
        self.target = target
        self.order = feature_order  # which tapped layer feeds each slot of the features
        self.feats: list[torch.Tensor] = []
        self.temperature = 0.0
        self.generator: torch.Generator | None = None

    def set_sampling(self, temperature: float, generator: torch.Generator | None) -> None:
        self.temperature, self.generator = temperature, generator

    def _add(self, features_SF: torch.Tensor | None) -> None:
        assert features_SF is not None
        parts = features_SF.double().chunk(len(self.order), dim=-1)
        self.feats.append(torch.cat([parts[i] for i in self.order], dim=-1))

    def start(self, prompt_ids_P: torch.Tensor, features_PF: torch.Tensor | None) -> None:
        self.feats = []
        self._add(features_PF)

    def __call__(
        self, ids_N: torch.Tensor, new_features_SF: torch.Tensor | None
    ) -> torch.Tensor | Proposal:
        if new_features_SF is not None:
            self._add(new_features_SF)
        feats = torch.cat(self.feats)
        anchor = ids_N.numel() - 1
        assert feats.shape[0] == anchor
        mask = torch.full((self.block_size - 1,), int(self.cfg["dflash_config"]["mask_token_id"]))
        block = self.target.embed(torch.cat([ids_N[-1:], mask])).double()
        hidden = reference_draft(self.cfg, self.w, feats, block, anchor)
        lm_head = self.target.lm_head_weight.double()
        if "dflash2" not in self.cfg:
            return (hidden[1:] @ lm_head.t()).argmax(-1)
        walk = (self.cfg, self.w, hidden, int(ids_N[-1]), lm_head)
        if self.temperature == 0:
            return torch.tensor(reference_walk(*walk)[0])
        tokens, q, cand = reference_sampled_walk(*walk, self.temperature, self.generator)
        return Proposal(torch.tensor(tokens), q, cand)


def reader_export(trained: Trained) -> Path:
    """`dflash export --to zlab` of the run, float32 (the reader then reads what was trained)."""
    out = trained.tmp / "zlab_reader"
    if not out.exists():
        argv = ["export", str(trained.run_dir), "--to", "zlab", str(out), "--dtype", "float32"]
        assert main(argv) == 0
    return out


def reader_tau(
    trained: Trained,
    feature_order: list[int],
    temperature: float = 0.0,
    seeds: Sequence[int] = (0,),
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> tuple[float, list[int]]:
    """Pooled tau of the speculative loop driving the reader (one response per seed), and
    the accepted counts; at temperature > 0 each response must be the memorized answer."""
    drafter = ReaderDrafter(reader_export(trained), trained.target, feature_order, edit)
    accepted: list[int] = []
    for seed in seeds:
        g = generate(
            trained.target,
            trained.prompt_ids,
            drafter,
            max_new_tokens=NEW_TOKENS,
            temperature=temperature,
            generator=torch.Generator().manual_seed(seed),
        )
        if temperature > 0:  # the target's own t=1 sample is the memorized answer
            assert g.tokens == trained.answer, (seed, g.tokens, trained.answer)
        accepted += g.accepted
    return sum(a + 1 for a in accepted) / len(accepted), accepted


def test_independent_reader_of_the_export_accepts_the_memorized_answer(trained: Trained) -> None:
    tau, accepted = reader_tau(trained, [0, 1])
    print(f"independent reader tau {tau:.3f}")
    assert tau >= GATE, accepted


# ----------------------------------------------------------------------------- the gate can fail


class ShiftedContext(DFlashBlockDrafter):
    """Context features given RoPE positions one ahead of their tokens (an off-by-one
    between the feature of token i and its position, as a misaligned tap would give)."""

    def _extend(self, features_SF: torch.Tensor | None) -> None:
        assert features_SF is not None
        n, s = self.cache.length, features_SF.shape[0]
        positions = torch.arange(n + 1, n + 1 + s)
        self.model.extend_cache(self.cache, features_SF.to(self.dtype), positions)


def served_tau(trained: Trained, layer_ids: list[int], shift_context: bool = False) -> float:
    """tau of the trained drafter served with other tapped layers or shifted positions."""
    drafter, _ = build_drafter(trained.run_dir)
    target = FrozenTarget(trained.target.model, layer_ids)
    kind = ShiftedContext if shift_context else DFlashBlockDrafter
    g = generate(target, trained.prompt_ids, kind(drafter, target), max_new_tokens=NEW_TOKENS)
    return sum(a + 1 for a in g.accepted) / len(g.accepted)


@pytest.mark.parametrize(
    "broken",
    ["tapped layers shifted by one", "context positions shifted by one", "features reordered"],
)
def test_a_broken_serving_path_fails_the_gate(trained: Trained, broken: str) -> None:
    with torch.no_grad():
        if broken == "tapped layers shifted by one":
            tau = served_tau(trained, [i + 1 for i in LAYER_IDS])
        elif broken == "context positions shifted by one":
            tau = served_tau(trained, LAYER_IDS, shift_context=True)
        else:
            tau, _ = reader_tau(trained, [1, 0])
    print(f"{broken}: tau {tau:.3f}")
    assert tau < 0.5 * BLOCK, tau


# ----------------------------------------------------------------------------- DFlash2

DFLASH2 = {
    "kind": "dflash2",
    "conv_group_size": 8,
    "selector_rank": 8,
    "selector_top_k": 4,
    # DFlash2 engines run sliding layers bidirectionally inside the block; full layers are
    # what every engine and this trainer agree on.
    "layer_types": ["full_attention", "full_attention"],
}
SEEDS = 4
SAMPLED = EvalConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)
"""The sampled path at t=1: the selector's walk drawn from its q over the K candidates,
verified by rejection sampling. The DFlash2 target is `make_confident`'s, whose t=1 samples
follow the greedy answer the drafter memorized; each slot is then accepted with about the
drafter's q of the right token, so one response's tau varies with the draws (7.0 to 8.0
over eight seeds): the gate pools SEEDS responses (seeds 0..SEEDS-1). The sampled path's
exactness is tests/test_speculative_sampling.py's chi-square test."""


@pytest.fixture(scope="module")
def trained2(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(tmp_path_factory.mktemp("overfit2"), DFLASH2, confident=True)
    finally:
        torch.set_num_threads(before)


def test_dflash2_eval_loop_accepts_the_memorized_answer_greedy_and_sampled(
    trained2: Trained,
) -> None:
    drafter, _ = build_drafter(trained2.run_dir)
    assert drafter.candidate_selector is not None
    args = (trained2.target, trained2.tokenizer)
    greedy = evaluate_prompts(drafter, *args, [trained2.messages], GREEDY, baseline=True)
    print(f"DFlash2 train {trained2.train_s:.1f} s; t=0 tau {greedy['tau']:.3f}")
    assert greedy["lossless_mismatches"] == 0
    assert greedy["tau"] >= GATE, greedy["responses"][0]["accepted"]
    sampled = evaluate_prompts(drafter, *args, [trained2.messages] * SEEDS, SAMPLED)
    print(f"DFlash2 t=1 sampled walk pooled tau {sampled['tau_pooled']:.3f}")
    answer = trained2.tokenizer.decode(trained2.answer, skip_special_tokens=True)
    assert [r["text"] for r in sampled["responses"]] == [answer] * SEEDS
    assert sampled["tau_pooled"] >= GATE, [r["accepted"] for r in sampled["responses"]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dflash_eval_on_a_dflash2_zlab_export_accepts_the_memorized_answer(
    trained2: Trained, temperature: float
) -> None:
    """`dflash eval` on the float32 z-lab DFlash2 export (the importer reads it back)."""
    prompts = trained2.tmp / "prompts.jsonl"
    prompts.write_text((json.dumps({"messages": trained2.messages}) + "\n") * SEEDS)
    report = trained2.tmp / f"zlab_eval_t{temperature}.json"
    argv = ["eval", "--drafter", str(reader_export(trained2)), "--prompts", str(prompts)]
    argv += [
        "--target",
        str(trained2.target_dir),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--device",
        "cpu",
        "--no-baseline",
    ]
    argv += ["--temperature", str(temperature), "--no-progress", "--json", str(report)]
    assert main(argv) == 0
    res = next(iter(json.loads(report.read_text())["sets"].values()))
    print(f"dflash eval (DFlash2 z-lab export) t={temperature} pooled tau {res['tau_pooled']:.3f}")
    answer = trained2.tokenizer.decode(trained2.answer, skip_special_tokens=True)
    assert [r["text"] for r in res["responses"]] == [answer] * SEEDS
    assert res["tau_pooled"] >= GATE, [r["accepted"] for r in res["responses"]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_independent_reader_of_a_dflash2_export_accepts_the_memorized_answer(
    trained2: Trained, temperature: float
) -> None:
    seeds = range(SEEDS) if temperature > 0 else range(1)
    tau, accepted = reader_tau(trained2, [0, 1], temperature, seeds)
    print(f"independent DFlash2 reader t={temperature} pooled tau {tau:.3f}")
    assert tau >= GATE, accepted


@pytest.mark.parametrize("broken", ["convolutions dropped", "convolution taps swapped"])
def test_a_broken_dflash2_serving_path_fails_the_gate(trained2: Trained, broken: str) -> None:
    drafter, _ = build_drafter(trained2.run_dir)
    with torch.no_grad():
        for layer in drafter.layers:
            if broken == "convolutions dropped":
                layer.attention_conv = layer.mlp_conv = None
            else:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.copy_(conv.base_kernel.flip(1))
    args = (trained2.target, trained2.tokenizer, [trained2.messages])
    tau = evaluate_prompts(drafter, *args, GREEDY)["tau"]
    print(f"DFlash2 {broken}: tau {tau:.3f}")
    assert tau < 0.5 * BLOCK, tau


def swap_taps(w: dict[str, torch.Tensor]) -> None:
    for name in [n for n in w if n.endswith("_conv.base_kernel")]:
        w[name] = w[name].flip(1)


def drop_dynamic_part(w: dict[str, torch.Tensor]) -> None:
    for name in [n for n in w if n.endswith("_conv.kernel_projection.weight")]:
        w[name] = torch.zeros_like(w[name])


READER_BREAKS = {
    "convolution taps swapped": swap_taps,
    "convolution kernel projections zeroed": drop_dynamic_part,
}
"""Mistakes in reading the convolutions fail the gate. Codebook mistakes do not, and are left
to the parity test (test_export_dflash2.py: test_the_dflash2_comparison_catches_format_
mistakes): on one memorized document the backbone's own top candidate is right by a wide
margin, so the selector's pair term decides nothing at t=0 (codebooks swapped or zeroed:
tau 8.0) and only sharpens q at t=1 (pooled tau over seeds 0..3: 7.39 either way against
7.75), nowhere near failing. Swapping the convolution's two sides (base_kernel.flip(0))
does not fail it either (tau 8.0): the two sides trained alike here."""


@pytest.mark.parametrize("broken", sorted(READER_BREAKS))
def test_a_broken_dflash2_reader_fails_the_gate(trained2: Trained, broken: str) -> None:
    tau, _ = reader_tau(trained2, [0, 1], edit=READER_BREAKS[broken])
    print(f"DFlash2 reader, {broken}: tau {tau:.3f}")
    assert tau < 0.5 * BLOCK, tau
