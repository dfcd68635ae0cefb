"""Helpers for trainer tests: a tiny real llama target on disk and real prepared shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_trainer.config import Config, config_from_dict
from dflash_trainer.data.shards import FORMAT_NAME, FORMAT_VERSION, MANIFEST, ShardWriter

VOCAB = 64


def write_tiny_target(
    path: Path, vocab_size: int = VOCAB, initializer_range: float = 0.3, hidden_size: int = 32
) -> Path:
    """A 4-layer llama (random weights, saved as safetensors) the trainer loads like any HF model.

    4 heads: head_dim is hidden_size / 4 (8 by default; compiled FlexAttention on CUDA needs
    at least 16, so a test that runs the target through it passes hidden_size=64)."""
    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        # Trained heads give O(1) logits; the 0.02 default would make every target a
        # near-uniform one that no drafter can match in a few steps.
        initializer_range=initializer_range,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def write_prepared(
    path: Path,
    n_docs: int = 40,
    seed: int = 0,
    lo: int = 20,
    hi: int = 120,
    learnable: bool = False,
) -> Path:
    """Real prepared shards of 'conversations' (prompt unsupervised, answer supervised).

    learnable: each document counts up from a random start (x[i+1] = x[i] + 1), so a
    drafter can learn the continuation from the anchor token alone.
    """
    rng = np.random.default_rng(seed)
    w = ShardWriter(path, "train", shard_tokens=600)
    for i in range(n_docs):
        n = int(rng.integers(lo, hi))
        if learnable:
            ids = ((int(rng.integers(0, VOCAB - 2)) + np.arange(n)) % (VOCAB - 2)).astype(np.int32)
        else:
            ids = rng.integers(0, VOCAB - 2, n).astype(np.int32)
        mask = np.zeros(n, dtype=bool)
        mask[n // 3 :] = True
        w.add(f"doc{i}", ids, mask)
    entries = w.close()
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "splits": {
            "train": {
                "documents": n_docs,
                "tokens": sum(e["tokens"] for e in entries),
                "supervised_tokens": sum(e["supervised_tokens"] for e in entries),
                "shards": entries,
            }
        },
    }
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def tiny_config(tmp: Path, **sections) -> Config:
    target = tmp / "target"
    if not target.exists():
        write_tiny_target(target)
    data = tmp / "data"
    if not data.exists():
        write_prepared(data)
    base = {
        "target": {"name_or_path": str(target), "dtype": "float32"},
        "drafter": {
            "num_layers": 2,
            "block_size": 4,
            "num_target_layers": 2,
            "mask_token_id": VOCAB - 1,
            "geometry": None,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 6,
        },
        "data": {"train": str(data), "token_budget": 256},
        "training": {
            "max_steps": 8,
            "lr": 3e-3,
            "max_anchors": 32,
            "log_every": 2,
            "checkpoint_every": 4,
            "compile": False,
            "precision": "fp32",
            "device": "cpu",
        },
        "run": {"output_dir": str(tmp / "run")},
    }
    for name, changes in sections.items():
        base.setdefault(name, {}).update(changes)
    return config_from_dict(base)


def train_finished_run(tmp: Path) -> Config:
    """A 4-step run under `tmp`, checkpoints at steps 2 and 4 (tests copy it before changing it)."""
    from dflash_trainer.train.trainer import Trainer

    cfg = tiny_config(tmp, training={"max_steps": 4, "checkpoint_every": 2, "log_every": 1})
    Trainer(cfg, log_to_console=False).train()
    return cfg


def stop_after_checkpoint(cfg: Config, total_steps: int = 8, stop_at: int = 4) -> None:
    """Train `cfg` to step `stop_at` of a `total_steps` schedule, logging every 2 steps, and
    checkpoint there: the run a SIGTERM between steps leaves behind, for a resume to finish."""
    from dflash_trainer.train.trainer import Trainer

    tr = Trainer(cfg, log_to_console=False)
    tr.total_steps = total_steps
    tr._stop_signal = None
    window = []
    while tr.step < stop_at:
        window.append(tr.train_step())
        if tr.step % 2 == 0:
            tr._log_window(window)
            window = []
    tr.save_checkpoint()
    tr.metrics.close()


def copy_run(finished: tuple[Path, Config], dest: Path) -> Config:
    """A copy of the finished run under `dest`, and its config pointing there."""
    import shutil

    from dflash_trainer.config import replace

    src, cfg = finished
    shutil.copytree(src / "run", dest / "run")
    return replace(cfg, run={"output_dir": str(dest / "run")})
