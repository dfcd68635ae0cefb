"""A real lineage built on CPU for the lineage tests (no tests here): a tiny llama target and
tokenizer made in code, three continuations (from scratch, from a run directory, from a
bf16 z-lab export), each on prompts no earlier one trained on, each served on two GSM8K and
two MT-Bench prompts and the report attached (`dflash lineage add-eval`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from test_data_support import tiny_tokenizer, write_jsonl

from dflash_trainer.cli import main
from dflash_trainer.config import config_from_dict

STEPS = 8
LR = 1e-2

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "hello",
    "how",
    "can",
    "help",
    "you",
    "today",
    "add",
    "numbers",
    "return",
    "step",
    "answer",
    "question",
    "reasoning",
    "assistant",
]


def conversation(i: int) -> dict[str, Any]:
    """`mix/c<i>`: one or two turns of words; answers long enough to supervise blocks."""
    w = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(40)]
    msgs = [
        {"role": "user", "content": f"question {i}: " + " ".join(w[:8])},
        {"role": "assistant", "content": " ".join(w[8:40])},
    ]
    if i % 3 == 0:
        msgs += [
            {"role": "user", "content": "and then " + " ".join(w[:5])},
            {"role": "assistant", "content": " ".join(reversed(w[10:34]))},
        ]
    return {"id": f"mix/c{i}", "messages": msgs}


def base_config(root: Path, target: Path, data: Path, out: Path) -> dict[str, Any]:
    vocab = len(tiny_tokenizer())
    return {
        "target": {"name_or_path": str(target), "dtype": "float32"},
        "drafter": {
            "num_layers": 1,
            "block_size": 4,
            "target_layer_ids": [1, 3],
            "mask_token_id": vocab - 1,
            "geometry": None,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
        },
        "data": {"train": str(data), "token_budget": 512},
        "training": {
            "max_steps": STEPS,
            "lr": LR,
            "warmup_ratio": 0.25,
            "max_anchors": 16,
            "log_every": 2,
            "checkpoint_every": 100,
            "compile": False,
            "precision": "fp32",
            "device": "cpu",
            "eval_every": 0,
        },
        "run": {"output_dir": str(out)},
    }


@dataclass
class Chain:
    root: Path
    target: Path
    runs: list[Path] = field(default_factory=list)
    prepared: list[Path] = field(default_factory=list)
    export: Path | None = None
    evals: list[Path] = field(default_factory=list)
    excluded: list[int] = field(default_factory=list)


def _prepare(chain: Chain, name: str, n: int, exclude: Path | None) -> Path:
    src = write_jsonl(chain.root / f"{name}.jsonl", [conversation(i) for i in range(n)])
    out = chain.root / f"prep_{name}"
    argv = ["data", "prepare", "--input", str(src), "--tokenizer", str(chain.target)]
    argv += ["--out", str(out), "--eval-fraction", "0"]
    if exclude is not None:
        argv += ["--exclude-lineage", str(exclude)]
    assert main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    chain.excluded.append(manifest["read_report"]["skipped"].get("in_lineage", 0))
    chain.prepared.append(out)
    return out


def _train(chain: Chain, k: int, data: Path, init: Path | None) -> Path:
    out = chain.root / f"run{k}"
    cfg = base_config(chain.root, chain.target, data, out)
    cfg["training"]["seed"] = k
    config_from_dict(cfg)  # checked before it is written
    path = chain.root / f"run{k}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = ["train", "--config", str(path), "--skip-doctor"]
    if init is not None:
        argv += ["--init-from", str(init)]
    assert main(argv) == 0
    chain.runs.append(out)
    return out


def _serve(chain: Chain, k: int, drafter: Path) -> None:
    """`dflash eval` (GSM8K and MT-Bench, both turns) and `dflash lineage add-eval`."""
    out = chain.root / f"eval{k}"
    argv = ["eval", "--drafter", str(drafter), "--target", str(chain.target)]
    argv += ["--prompts", "gsm8k,mt-bench", "--max-samples", "2", "--max-new-tokens", "16"]
    argv += ["--device", "cpu", "--no-baseline", "--no-progress", "--out-dir", str(out)]
    assert main(argv) == 0
    assert main(["lineage", "add-eval", str(drafter), str(out)]) == 0
    chain.evals.append(out)


def write_target(path: Path) -> Path:
    """A 4-layer llama with the tiny tokenizer. Weights of std 0.3 give O(1) logits, so its
    greedy answers follow its context, which a drafter can learn (at the 0.02 default every
    answer is one repeated token and every drafter drafts it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        initializer_range=0.3,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_chain(root: Path) -> Chain:
    target = write_target(root / "target")
    chain = Chain(root, target)
    run0 = _train(chain, 0, _prepare(chain, "a", 12, None), None)
    _serve(chain, 0, run0)
    run1 = _train(chain, 1, _prepare(chain, "b", 24, run0), run0)
    chain.export = root / "published"
    argv = ["export", str(run1), "--to", "zlab", str(chain.export), "--target", str(target)]
    assert main(argv) == 0
    _serve(chain, 1, chain.export)
    run2 = _train(chain, 2, _prepare(chain, "c", 36, chain.export), chain.export)
    _serve(chain, 2, run2)
    return chain
