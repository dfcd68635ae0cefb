"""Regeneration's backends by name: HF batches, the static engine, an OpenAI-compatible server.

A module of its own so that regenerate.py imports no backend it does not run (the engine
imports torch's compiler paths; the server client is plain HTTP).
"""

from __future__ import annotations

from typing import Any

from dflash_trainer.data.hf_generate import HFBatchGenerator
from dflash_trainer.data.settings import GenerationSettings
from dflash_trainer.errors import DFlashError

BACKENDS = ("hf", "static", "openai")


def make_generator(
    model: Any,
    settings: GenerationSettings,
    stops: list[int],
    pad_id: int,
    batch_size: int,
    engine: dict[str, Any] | None = None,
    server: Any = None,
    tokenizer: Any = None,
) -> Any:
    """The backend named in `settings`; `server` (openai_backend.ServerOptions) for openai."""
    if settings.backend == "hf":
        return HFBatchGenerator(model, settings, stops, pad_id, batch_size)
    if settings.backend == "static":
        from dflash_trainer.data.engine import StaticBatchEngine

        return StaticBatchEngine(model, settings, stops, pad_id, rows=batch_size, **(engine or {}))
    if settings.backend == "openai":
        if server is None:
            raise DFlashError("backend openai needs a server (--base-url and --model)")
        return server.generator(settings, stops, tokenizer)
    raise DFlashError(f"unknown backend {settings.backend!r}; use one of {list(BACKENDS)}")
