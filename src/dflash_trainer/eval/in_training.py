"""The evaluation a training run does every `training.eval_every` steps.

Training accuracy can look fine while served acceptance is ~1, so the trainer measures
two served numbers as it goes:

- the real speculative loop on a few prompts of the first eval prompt set (measured
  tau, the number serving will see);
- the held-out split walked as greedy serving walks it (eval/walk.py): the in-batch
  tau's served counterpart on the training distribution, since uniform anchors overstate
  what serving, which counts tokens per step, will see.

Both run on one process holding the whole drafter and target; `InTrainingEval.run`
says why it skips otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from torch import nn

from dflash_trainer.config import Config
from dflash_trainer.target.model import FrozenTarget


class InTrainingEval:
    """Holds what stays the same between evaluations (tokenizer, prompts, held-out docs)."""

    def __init__(self, cfg: Config, tokenizer_name: str, held_out: Sequence[Any] | None) -> None:
        self.cfg = cfg
        self.tokenizer_name = tokenizer_name
        self.held_out = held_out
        self._tokenizer: Any = None
        self._prompts: list[Any] | None = None

    def run(
        self, step: int, drafter: nn.Module, target: FrozenTarget, drafter_sharded: bool
    ) -> tuple[dict[str, Any] | None, str]:
        """(metrics record or None, a log line). Leaves the drafter in training mode."""
        if drafter_sharded:
            return None, "in-training eval skipped: the drafter is FSDP-sharded"
        if target.sharded:
            # One rank alone cannot run a target whose layers need every rank's all-gather.
            return None, "in-training eval skipped: the target is FSDP-sharded"
        try:
            return self._measure(step, drafter, target)
        finally:
            drafter.train()

    def _measure(
        self, step: int, drafter: nn.Module, target: FrozenTarget
    ) -> tuple[dict[str, Any], str]:
        from dflash_trainer.eval.evaluate import evaluate_prompts

        ev = self.cfg.eval
        tokenizer, prompts = self._prompt_set()
        t0 = time.perf_counter()
        out = evaluate_prompts(drafter, target, tokenizer, prompts, ev)
        rec: dict[str, Any] = {
            "step": step,
            "eval_set": ev.prompts[0],
            "eval_tau": float(out["tau"]),
            "eval_tau_pooled": float(out["tau_pooled"]),
            "eval_time_s": time.perf_counter() - t0,
        }
        msg = f"step {step}: measured tau on {ev.prompts[0]} = {rec['eval_tau']:.2f}"
        walk = self.heldout_walk(drafter, target)
        if walk is not None:
            rec.update(heldout_walk_tau=walk["tau"], heldout_walk_time_s=walk["seconds"])
            msg += f", walked held-out tau = {walk['tau']:.2f} ({walk['documents']:.0f} documents)"
        return rec, msg

    def _prompt_set(self) -> tuple[Any, list[Any]]:
        if self._prompts is None:
            from dflash_trainer.data.loading import load_tokenizer
            from dflash_trainer.eval.prompts import load_prompt_set

            ev = self.cfg.eval
            self._tokenizer = load_tokenizer(self.tokenizer_name)
            ps = load_prompt_set(ev.prompts[0], max_samples=ev.train_eval_samples, seed=ev.seed)
            self._prompts = [p.messages for p in ps.prompts]
        return self._tokenizer, self._prompts

    def heldout_walk(self, drafter: nn.Module, target: FrozenTarget) -> dict[str, float] | None:
        """The held-out split walked as greedy serving walks it, or None (no split, or off)."""
        n = self.cfg.eval.train_walk_docs
        if not n or self.held_out is None:
            return None
        from dflash_trainer.eval.walk import walked_tau

        t0 = time.perf_counter()
        docs = [self.held_out[i] for i in range(min(n, len(self.held_out)))]
        # Each answer is walked over its first eval.max_new_tokens tokens, the length the
        # served eval measures (and a bound on the walk's cost for long documents).
        out = walked_tau(drafter, target, docs, self.cfg.eval.max_new_tokens)
        out["seconds"] = time.perf_counter() - t0
        return out
