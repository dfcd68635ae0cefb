"""The per-turn decoding of one evaluation: chat rendering, stop ids, and each user turn
decoded speculatively (and target-only for the baseline) with its record.

`evaluate.evaluate_prompts` builds one `PromptRun` per prompt set and sums up its
`responses` and `Generation`s (report.summarize).
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_trainer.config import EvalConfig
from dflash_trainer.data.template_time import render_chat
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.prompts import Messages
from dflash_trainer.eval.report import lossless_check
from dflash_trainer.eval.speculative import BlockDrafter, Generation, generate
from dflash_trainer.eval.static_decode import DecodeEngines
from dflash_trainer.target.model import FrozenTarget


def render_prompt(tokenizer: Any, messages: Messages, enable_thinking: bool) -> list[int]:
    """Chat template with the generation prompt, tokenized without extra special tokens."""
    text = render_chat(
        tokenizer, messages, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """EOS of the tokenizer and of the model's generation config (an int or a list)."""
    ids: set[int] = set()
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return sorted(ids)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


class PromptRun:
    """One evaluation's loops and results: each user turn decoded speculatively (and
    target-only with `baseline`), answers fed back as the assistant turn."""

    def __init__(
        self,
        target: FrozenTarget,
        tokenizer: Any,
        eval_cfg: EvalConfig,
        engines: DecodeEngines,
        block: BlockDrafter,
        baseline: bool,
        stops: list[int],
    ) -> None:
        self.target, self.tokenizer, self.eval_cfg = target, tokenizer, eval_cfg
        self.engines, self.block, self.baseline = engines, block, baseline
        self.greedy = eval_cfg.temperature == 0
        self.kw: dict[str, Any] = {
            "max_new_tokens": eval_cfg.max_new_tokens,
            "temperature": eval_cfg.temperature,
            "top_p": eval_cfg.top_p,
            "stop_ids": stops,
        }
        self.spec_gens: list[Generation] = []
        self.base_gens: list[Generation] = []
        self.responses: list[dict[str, Any]] = []
        self.answers: list[tuple[list[int], list[int]]] = []
        """(prompt ids, speculative answer ids) of every response."""

    def loops(self, ids: list[int], speculative: bool) -> dict[str, Any]:
        """generate()'s drafter and runner for this prompt (both loops share the runner)."""
        limit = _context_length(self.target.model)
        if limit is not None and len(ids) > limit:
            # Past its positions the model is undefined, and a hostile prompt (or template) of
            # millions of tokens would prefill for hours: refused before any decoding.
            raise DFlashError(
                f"a prompt renders to {len(ids):,} tokens, more than the target's context of "
                f"{limit:,} (max_position_embeddings); shorten or drop it from --prompts"
            )
        self.engines.ensure(len(ids) + self.eval_cfg.max_new_tokens + 2 * self.block.block_size)
        d = (self.engines.drafter or self.block) if speculative else None
        return {"drafter": d, "runner": self.engines.runner}

    def warm_up(self, first: Messages) -> None:
        """Decode the first prompt briefly with both loops, untimed (one-off costs)."""
        upto = next((j for j, m in enumerate(first) if m["role"] == "user"), len(first))
        ids = render_prompt(self.tokenizer, first[: upto + 1], self.eval_cfg.enable_thinking)
        short = {**self.kw, "max_new_tokens": min(16, self.eval_cfg.max_new_tokens)}
        for spec in (True, False) if self.baseline else (True,):
            gen = _generator(self.target.device, 0)
            generate(self.target, ids, generator=gen, **short, **self.loops(ids, spec))

    def conversation(self, conversation: Messages, prompt_id: str) -> None:
        history: Messages = []
        for j, msg in enumerate(conversation):
            history.append(dict(msg))
            answered = j + 1 < len(conversation) and conversation[j + 1]["role"] == "assistant"
            if msg["role"] != "user" or answered:
                continue
            rec = self.answer(history, prompt_id)
            history.append({"role": "assistant", "content": rec["text"]})

    def answer(self, history: Messages, prompt_id: str) -> dict[str, Any]:
        """Decode one turn (and its baseline); its record is appended to `responses`."""
        ids = render_prompt(self.tokenizer, history, self.eval_cfg.enable_thinking)
        # One seed per response: the same turn samples alike in both runs.
        seed = self.eval_cfg.seed + len(self.responses)
        gen = _generator(self.target.device, seed)
        g = generate(self.target, ids, generator=gen, **self.kw, **self.loops(ids, True))
        self.spec_gens.append(g)
        self.answers.append((ids, list(g.tokens)))
        rec = _record(g, prompt_id, history)
        if self.baseline:
            gen = _generator(self.target.device, seed)
            b = generate(
                self.target,
                ids,
                generator=gen,
                record_margins=self.greedy,
                **self.kw,
                **self.loops(ids, False),
            )
            self.base_gens.append(b)
            rec["baseline"] = {
                "new_tokens": len(b.tokens),
                "prefill_s": b.prefill_s,
                "decode_s": b.decode_s,
            }
            if self.greedy:
                rec["lossless"] = lossless_check(g, b)
        rec["text"] = self.tokenizer.decode(g.tokens, skip_special_tokens=True)
        self.responses.append(rec)
        return rec


def _context_length(model: Any) -> int | None:
    cfg: Any = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    limit = getattr(text, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def _record(g: Generation, prompt_id: str, history: Messages) -> dict[str, Any]:
    return {
        "prompt": prompt_id,
        "turn": sum(m["role"] == "user" for m in history) - 1,
        "prompt_tokens": g.prompt_len,
        "new_tokens": len(g.tokens),
        "tau": sum(a + 1 for a in g.accepted) / len(g.accepted) if g.accepted else None,
        "accepted": g.accepted,
        "stop_reason": g.stop_reason,
        "prefill_s": g.prefill_s,
        "decode_s": g.decode_s,
    }
