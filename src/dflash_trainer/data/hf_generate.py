"""Regeneration with plain HF `generate`: left-padded batches (the portable backend), and one
prompt at a time (the baseline the benchmarks compare the static engine against)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash_trainer.data.settings import GenerationSettings
from dflash_trainer.errors import DFlashError


def _hf_generation_config(settings: GenerationSettings, stops: list[int], pad: int) -> Any:
    from transformers import GenerationConfig

    # Built from scratch, not from the model's generation_config: the settings recorded in the
    # output must be the ones used (a model default such as top_k=50 would silently apply).
    sampling = settings.temperature > 0
    return GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=sampling,
        temperature=settings.temperature if sampling else None,
        top_p=settings.top_p if sampling else None,
        top_k=0 if sampling else None,
        eos_token_id=stops,
        pad_token_id=pad,
    )


class HFBatchGenerator:
    """Left-padded batched `model.generate`."""

    def __init__(
        self, model: Any, settings: GenerationSettings, stops: list[int], pad_id: int, batch: int
    ) -> None:
        self.model, self.pad_id = model, pad_id
        self.max_batch: int | None = batch
        self.config = _hf_generation_config(settings, stops, pad_id)
        self.oom_splits = 0  # batches split in halves after running out of GPU memory

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """Generate for every prompt; a batch that runs out of GPU memory is split in halves.

        Why: windows are sorted shortest-first, so the last batches hold the longest prompts
        and the attention workspace grows with their square; a fixed batch size that fits
        the first batches can fail on the last ones (seen on the H200 with 4 jobs sharing the
        GPU). Halving keeps the job alive and its output identical for greedy decoding.
        """
        import torch

        try:
            return self._generate_batch(prompts)
        except torch.OutOfMemoryError:
            if len(prompts) == 1:
                raise DFlashError(
                    "out of GPU memory generating a single prompt of "
                    f"{len(prompts[0])} tokens; lower --max-prompt-tokens or --max-new-tokens, "
                    "or free the GPU"
                ) from None
            torch.cuda.empty_cache()
            self.oom_splits += 1
            half = len(prompts) // 2
            return self.generate(prompts[:half]) + self.generate(prompts[half:])

    def _generate_batch(self, prompts: list[list[int]]) -> list[list[int]]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p) :] = 1
        device = self.model.device
        with torch.inference_mode():
            out = self.model.generate(
                ids.to(device), attention_mask=attn.to(device), generation_config=self.config
            )
        return [row.tolist() for row in out[:, width:].cpu()]


def per_prompt_generate(
    model: Any,
    prompts: Sequence[list[int]],
    settings: GenerationSettings,
    stops: list[int],
    pad_id: int,
) -> list[list[int]]:
    """The baseline: plain HF `generate`, one prompt at a time, no padding, no batching."""
    import torch

    config = _hf_generation_config(settings, stops, pad_id)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long, device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outs.append(out[0, len(p) :].tolist())
    return outs
