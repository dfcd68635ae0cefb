"""vLLM itself (the CPU build, `make vllm-env`) serving SmolLM2-135M-Instruct with the published
drafter: regeneration through it equals HF greedy token for token, its acceptance counters
agree with `dflash eval` on the same prompts within 5% with greedy output equal to the
target's, and the server and every process it started are gone afterwards.

Skipped, with the reason, when .venv-vllm is absent (no registry to install vLLM from).
About 3 minutes on the 2-core CPU machine, most of it vLLM's start and `dflash eval`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from dflash_trainer.data.openai_client import OpenAIClient
from dflash_trainer.errors import DFlashError
from dflash_trainer.serve.vllm_server import group_alive, vllm_python

pytestmark = pytest.mark.slow  # a vLLM server on the real asset: minutes

ROOT = Path(__file__).parents[1]
DRAFTER = ROOT / "drafters" / "smollm2-135m-dflash-b16"


def _python() -> Path:
    try:
        return vllm_python()
    except DFlashError as e:
        pytest.skip(f"vLLM is not installed here ({e})")


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(
        drafter=str(DRAFTER), target=None, prompts="gsm8k", max_samples=3, max_new_tokens=64,
        seed=0, out=tmp_path / "check.json", base_url=None, model=None, vllm_python=None,
        dtype="float32", startup_timeout=900.0, kv_cache_gib=1.0, max_model_len=4096,
        log=tmp_path / "vllm.log",
    )  # fmt: skip


def _regenerate_through(server: Any, models: Any, tmp_path: Path) -> None:
    """(a) A handful of prompts: the served ids equal HF greedy's, and the records
    regenerate writes through the server hold HF greedy's text."""
    from dflash_trainer.data.hf_generate import per_prompt_generate
    from dflash_trainer.data.openai_backend import ServerOptions
    from dflash_trainer.data.records import Conversation
    from dflash_trainer.data.regenerate import regenerate
    from dflash_trainer.data.settings import GenerationSettings
    from dflash_trainer.eval.prompts import load_prompt_set

    tok, model = models.tokenizer, models.target.model
    prompts = load_prompt_set("gsm8k", 4, seed=1).prompts
    convs = [Conversation(p.id, p.messages) for p in prompts]
    client = OpenAIClient(server.base_url, server.served_name, timeout=600)
    out = tmp_path / "regen.jsonl"
    report = regenerate(
        convs, None, tok, out, max_new_tokens=32, model_name=server.served_name,
        backend="openai", progress=False, server=ServerOptions(client, concurrency=2),
    )  # fmt: skip
    assert report.written == 4 and report.server is not None
    assert report.server["retokenized"] == 0 and report.server["failed"] == 0
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    settings = GenerationSettings(server.served_name, max_new_tokens=32)
    stops = [tok.eos_token_id]
    gen = ServerOptions(client).generator(settings, stops, tok)
    for c in convs:
        ids = tok.apply_chat_template(c.messages[:1], add_generation_prompt=True, tokenize=False)
        prompt = list(tok(ids, add_special_tokens=False)["input_ids"])
        served = gen.generate([prompt])[0]
        hf = per_prompt_generate(model, [prompt], settings, stops, tok.eos_token_id)[0]
        assert served == hf  # token for token, the stop token included
        answer = records[c.id]["messages"][-1]["content"]
        assert answer == tok.decode([t for t in hf if t not in stops], skip_special_tokens=True)


def test_vllm_cpu_serves_the_published_drafter_as_dflash_eval_measures_it(tmp_path: Path) -> None:
    from dflash_trainer.eval.loading import load_eval_models
    from dflash_trainer.serve.check import local_server, run_check

    python = _python()
    args = _args(tmp_path)
    models = load_eval_models(args.drafter, None, args.dtype, "cpu")
    with local_server(models, args, python) as (server, export):
        assert server.proc is not None
        pgid = server.proc.pid
        assert group_alive(pgid)
        assert "python -m vllm.entrypoints.openai.api_server" in "\n".join(export.commands.values())
        _regenerate_through(server, models, tmp_path)
        # (b) the check itself, pointed at this server.
        args.base_url, args.model = server.base_url, server.served_name
        report = run_check(args, models)
    # (c) the server and the engine and workers it forked are gone.
    assert server.proc.returncode is not None and not group_alive(pgid)
    s = report["sets"]["gsm8k"]
    assert s["prompts"] == 3 and s["greedy_equal"] == 3 and s["requests_failed"] == 0
    assert s["dflash_eval_lossless_mismatches"] == 0 and s["vllm_drafts"] > 0
    assert abs(s["vllm_tau"] - s["dflash_eval_tau"]) <= 0.05 * s["dflash_eval_tau"], s
