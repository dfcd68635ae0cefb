"""A small real world for the hostile-user tests (no tests here): a tiny llama target with the
tiny tokenizer, conversations, a prompt-sources YAML, a run holding a drafter built for that
target, a z-lab export of it, a drafter directory with a lineage, and an eval report.
Everything is made by the CLI itself, in code, in a few seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from lineage_chain import conversation, write_target
from test_data_support import tiny_tokenizer, write_jsonl

from dflash_trainer.cli import main
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.formats.drafter_io import save_drafter_files

SRC = Path(__file__).resolve().parent.parent / "src"


@dataclass
class World:
    root: Path
    target: Path
    conversations: Path
    sources: Path
    prompts: Path
    run: Path
    export: Path
    drafter: Path  # a drafter directory with a lineage (for `lineage add-eval`)
    report: Path  # an eval.json


def _spec(vocab: int) -> DrafterSpec:
    """A one-layer drafter for the 4-layer, hidden-32 target of lineage_chain.write_target."""
    return DrafterSpec(
        hidden_size=32,
        vocab_size=vocab,
        target_hidden_size=32,
        num_target_hidden_layers=4,
        target_layer_ids=(1, 3),
        block_size=4,
        mask_token_id=vocab - 1,
        num_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        rope_theta=10000.0,
        layer_types=("full_attention",),
        sliding_window=None,
        rms_norm_eps=1e-6,
        max_position_embeddings=1024,
    )


def eval_args(world: World, *out: str) -> list[str]:
    """`dflash eval` of the world's run on one prompt, four tokens, on the CPU."""
    return ["eval", "--drafter", str(world.run), "--target", str(world.target), "--prompts",
            str(world.prompts), "--max-samples", "1", "--max-new-tokens", "4", "--device", "cpu",
            "--no-baseline", "--no-progress", *out]  # fmt: skip


def build_world(root: Path) -> World:
    target = write_target(root / "target")
    convs = write_jsonl(root / "in.jsonl", [conversation(i) for i in range(6)])
    sources = root / "sources.yaml"
    sources.write_text(yaml.safe_dump({"sources": [{"name": "mix", "path": str(convs)}]}))
    prompts = write_jsonl(
        root / "prompts.jsonl",
        [
            {"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]}
            for i in range(2)
        ],
    )
    torch.manual_seed(0)
    spec = _spec(len(tiny_tokenizer()))
    meta = {"target": {"name_or_path": str(target), "dtype": "float32"}}
    save_drafter_files(root / "run" / "drafter", spec, DFlashDrafter(spec).state_dict(), meta)
    row = {"loss": 2.0, "exact_tau": 1.5, "expected_tau": 1.4, "slot_acc": [0.5, 0.2, 0.1],
           "lr": 1e-3, "tokens_per_s": 1e4}  # fmt: skip
    (root / "run" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, **row}) + "\n" for s in (1, 2))
    )
    world = World(root, target, convs, sources, prompts, root / "run", root / "export",
                  root / "drafter", root / "eval" / "eval.json")  # fmt: skip
    assert main(["export", str(world.run), "--to", "zlab", str(world.export),
                 "--target", str(target)]) == 0  # fmt: skip
    assert main(["import", str(world.export), "--out", str(world.drafter)]) == 0
    assert (
        main(["lineage", "init", str(world.drafter), "--prompts", str(convs), "--steps", "1"]) == 0
    )
    assert main(eval_args(world, "--out-dir", str(root / "eval"))) == 0
    return world


def dflash(
    argv: list[str], env: dict[str, str | None] | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """`dflash ARGV` in a fresh process (its own signals, streams and environment)."""
    full = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    kw.setdefault("capture_output", True)
    kw.setdefault("timeout", 120)
    return subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", *argv], env=full, text=True, **kw
    )


def tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` (or the file itself), by relative name, with its bytes."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def report_ok(path: Path) -> bool:
    data = json.loads(path.read_text())
    return isinstance(data, dict) and "sets" in data
