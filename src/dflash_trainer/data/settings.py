"""The settings of one generation job, shared by every regeneration backend.

A module of its own so that the backends (HF batched, the static engine, a server) and the
regeneration driver all import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationSettings:
    model: str
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    enable_thinking: bool | None = None
    """Passed to the chat template (Qwen3-style); None leaves the template's default."""
    backend: str = "hf"
    seed: int = 0
    stop_loops: bool = False
    """End an answer that loops (data/loop_tails.loop_stop; finish reason "loop")."""
