"""The pieces of `dflash serve-check` that need no vLLM of their own (check.py runs them):
conversations served turn by turn through an OpenAI-compatible server, the comparison with
`dflash eval`'s answers, and the target saved where vLLM can read it."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trainer.data.openai_client import OpenAIClient
from dflash_trainer.gguf_cache import strip_gguf_marks
from dflash_trainer.serve.metrics import SpecCounters, read_spec_counters


@dataclass
class ServedSet:
    """One prompt set's conversations as the server answered them."""

    texts: list[list[str]]
    """Per conversation, each turn's answer (decoded as `dflash eval` decodes its own)."""
    counters: SpecCounters
    failed: int = 0


def serve_conversations(
    client: OpenAIClient,
    tokenizer: Any,
    conversations: list[list[dict[str, str]]],
    max_new_tokens: int,
    stops: list[int],
    enable_thinking: bool = False,
    server_root: str | None = None,
) -> ServedSet:
    """Greedy answers turn by turn, fed back as history as `dflash eval` does; the spec
    counters' difference over the set when `server_root` is given."""
    from dflash_trainer.eval.prompt_run import render_prompt

    before = read_spec_counters(server_root) if server_root else SpecCounters()
    texts: list[list[str]] = []
    failed = 0
    for conversation in conversations:
        history: list[dict[str, str]] = []
        answers: list[str] = []
        for j, msg in enumerate(conversation):
            history.append(dict(msg))
            answered = j + 1 < len(conversation) and conversation[j + 1]["role"] == "assistant"
            if msg["role"] != "user" or answered:
                continue
            ids = render_prompt(tokenizer, history, enable_thinking)
            body = {"prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0}
            body |= {"stop_token_ids": stops, "return_token_ids": True}
            answer = client.complete("completions", body)
            if answer is None or answer.token_ids is None:
                failed += 1
                break
            text = tokenizer.decode(answer.token_ids, skip_special_tokens=True)
            answers.append(text)
            history.append({"role": "assistant", "content": text})
        texts.append(answers)
    after = read_spec_counters(server_root) if server_root else SpecCounters()
    return ServedSet(texts, after - before, failed)


def eval_texts(responses: list[dict[str, Any]], prompt_ids: list[str]) -> list[list[str]]:
    """`dflash eval`'s answers grouped per conversation, in prompt order."""
    by_prompt: dict[str, list[str]] = {p: [] for p in prompt_ids}
    for r in sorted(responses, key=lambda r: (prompt_ids.index(r["prompt"]), r["turn"])):
        by_prompt[r["prompt"]].append(r["text"])
    return [by_prompt[p] for p in prompt_ids]


def compare_set(
    served: ServedSet, evaluated: dict[str, Any], prompt_ids: list[str]
) -> dict[str, Any]:
    """The report's entry for one prompt set."""
    want = eval_texts(evaluated["responses"], prompt_ids)
    equal = sum(a == b for a, b in zip(served.texts, want))
    turns = sum(len(w) for w in want)
    turns_equal = sum(x == y for a, b in zip(served.texts, want) for x, y in zip(a, b))
    c = served.counters
    return {
        "vllm_tau": c.tau,
        "dflash_eval_tau": evaluated.get("tau_pooled"),
        "dflash_eval_tau_mean": evaluated.get("tau"),
        "greedy_equal": equal,
        "prompts": len(prompt_ids),
        "turns_equal": turns_equal,
        "turns": turns,
        "vllm_drafts": c.drafts,
        "vllm_draft_tokens": c.draft_tokens,
        "vllm_accepted_tokens": c.accepted_tokens,
        "dflash_eval_lossless_mismatches": evaluated.get("lossless_mismatches"),
        "requests_failed": served.failed,
    }


def plain_target_dir(model: Any, tokenizer: Any, out: Path) -> Path:
    """The target as a plain HF directory vLLM can load. A GGUF target was dequantised at
    load (`strip_gguf_marks`: the weights in memory are plain tensors)."""
    strip_gguf_marks(model).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def needs_plain_copy(name: str, gguf: str | None) -> bool:
    """Whether vLLM cannot read the target as named: a GGUF file, or an asset spec."""
    return gguf is not None or name.endswith(".gguf") or name.startswith("asset:")


def temp_dir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="dflash-serve-check-")
