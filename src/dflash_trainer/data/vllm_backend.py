"""The optional vLLM backend of regeneration: same interface as the HF batch generator.

Kept apart so that nothing else imports vllm (it is not a dependency and is not installed on
the CPU machines). vLLM batches and schedules by itself, so it gets a whole round at once.
Not exercised by the CPU test suite; the HF path is the reference.
"""

from __future__ import annotations

from typing import Any

from dflash_trainer.data.settings import GenerationSettings
from dflash_trainer.errors import DFlashError


def load_llm(model: str, dtype: str = "auto", seed: int = 0, tokenizer: str | None = None) -> Any:
    try:
        from vllm import LLM
    except ImportError as e:
        raise DFlashError(
            "--backend vllm needs vLLM: pip install vllm (or use --backend hf)"
        ) from e
    return LLM(model=model, tokenizer=tokenizer, dtype=dtype, seed=seed)


class VLLMGenerator:
    max_batch: int | None = None

    def __init__(self, llm: Any, settings: GenerationSettings, stops: list[int]) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.params = SamplingParams(
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_tokens=settings.max_new_tokens,
            stop_token_ids=stops,
            seed=settings.seed,
        )

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]
