"""How the speculative loop runs the target: one batch-1 sequence, forwards of a few tokens
at a time, and the rewind after a partial acceptance (docs/algorithm.md section 7).

`TargetRunner` is what `speculative.generate` drives; `DynamicTargetRunner` implements it
over an HF `DynamicCache` (`static_decode.StaticTargetRunner` is the fixed-size variant).

Rewinding the target cache: attention layers are cropped. Recurrent layers (Gated DeltaNet
in qwen3_5 / Qwen3.6, with a recurrent and a conv state) cannot be cropped: their state
after the verify forward has absorbed the rejected drafts. Before each verify the runner
snapshots those states (fixed size: they do not grow with the context), and after a partial
acceptance it restores them, crops the attention layers back to the anchor, and re-feeds the
committed tokens [x_a, d_1..d_accepted] in one extra forward. A fully accepted block needs
no re-feed. Sliding-window attention layers are told to keep their past until cropped.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch

from dflash_trainer.errors import DFlashError
from dflash_trainer.target.model import FrozenTarget

# ----------------------------------------------------------------------------- target cache


def _is_recurrent(layer: Any) -> bool:
    return hasattr(layer, "recurrent_states")


class TargetCache:
    """An HF `DynamicCache` for the target plus the rewind the loop needs (module docstring)."""

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        self.hf: Any = DynamicCache(config=model.config)
        layers = list(getattr(self.hf, "layers", []))
        if not layers:
            raise DFlashError(
                f"{type(model).__name__}: transformers built no per-layer cache from its config; "
                "the speculative loop needs transformers >= 5.17"
            )
        for layer in layers:
            if _is_recurrent(layer) and isinstance(layer, DynamicLayer):
                raise DFlashError(
                    f"{type(model).__name__}: a cache layer ({type(layer).__name__}) mixes "
                    "recurrent and attention states; the speculative loop cannot rewind it yet"
                )
            if isinstance(layer, DynamicSlidingWindowLayer):
                # Without this, tokens evicted from the window by a verify forward are lost
                # and a later crop cannot bring them back.
                layer.activate_past_recording()
        self.recurrent = [layer for layer in layers if _is_recurrent(layer)]
        self.attention = [layer for layer in layers if not _is_recurrent(layer)]
        self.length = 0
        """Tokens the cache has absorbed."""

    @property
    def has_recurrent(self) -> bool:
        return bool(self.recurrent)

    def snapshot(self) -> list[dict[str, dict[int, torch.Tensor]]]:
        """Copies of the recurrent layers' states (fixed size: ~150 MB fp32 for Qwen3.6-27B)."""
        snap = []
        for layer in self.recurrent:
            snap.append(
                {
                    name: {
                        k: v.clone()
                        for k, v in getattr(layer, name).items()
                        if isinstance(v, torch.Tensor)
                    }
                    for name in ("conv_states", "recurrent_states")
                }
            )
        return snap

    def restore(self, snap: list[dict[str, dict[int, torch.Tensor]]]) -> None:
        for layer, states in zip(self.recurrent, snap):
            for name, saved in states.items():
                current = getattr(layer, name)
                for k, v in saved.items():
                    cur = current.get(k)
                    if isinstance(cur, torch.Tensor) and cur.shape == v.shape:
                        cur.copy_(v)  # in place: the layer may hold this tensor's address
                    else:
                        current[k] = v

    def crop_attention(self, tokens_to_remove: int) -> None:
        """Drop the last tokens of every attention layer (and trim sliding windows)."""
        for layer in self.attention:
            layer.crop(-tokens_to_remove)


# ----------------------------------------------------------------------------- runners


def cache_kwarg(model: Any) -> str:
    """transformers renamed `past_key_values` to `cache` (5.24 keeps the old name deprecated)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class TargetRunner(Protocol):
    """Incremental target forwards for one sequence at a time (what `generate` drives).

    Two implementations: `DynamicTargetRunner` below (an HF DynamicCache, cropped and, for
    recurrent layers, restored and re-fed) and `static_decode.StaticTargetRunner` (a fixed-size
    cache, optionally replayed as CUDA graphs).
    """

    forwards: int
    """Target forwards since the last reset (generate resets it after the prefill)."""

    def begin(self) -> None:
        """Start a new sequence (the cache holds nothing)."""
        ...

    def forward(
        self, ids_S: torch.Tensor, taps: bool, last_logits_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [S or 1, V] fp32, features [S, F] or None) for the next S positions."""
        ...

    def after_prefill(self) -> None: ...

    def snapshot(self, block: int) -> Any:
        """What `rewind` needs to undo a verify forward of `block` tokens (or None)."""
        ...

    def rewind(self, block_S: torch.Tensor, kept: int, snapshot: Any) -> None:
        """After feeding `block_S`, keep only its first `kept` tokens in the cache."""
        ...


def target_forward(
    target: FrozenTarget, kwargs: dict[str, Any], taps: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One batch-1 target forward: (logits [S or kept, V] fp32, tapped features [S, F] or None)."""
    if not taps:
        return target.model(**kwargs).logits[0].float(), None
    with target.taps() as captured:
        out = target.model(**kwargs)
        feats = target.features_of(captured)[0]
    return out.logits[0].float(), feats


class DynamicTargetRunner:
    """`TargetRunner` over an HF DynamicCache; keeps TargetCache.length in step."""

    def __init__(self, target: FrozenTarget) -> None:
        self.target = target
        self.cache = TargetCache(target.model)
        self.cache_kwarg = cache_kwarg(target.model)
        self.forwards = 0

    def begin(self) -> None:
        self.cache = TargetCache(self.target.model)
        self.forwards = 0

    def forward(
        self, ids_S: torch.Tensor, taps: bool, last_logits_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        start, s = self.cache.length, ids_S.numel()
        kwargs: dict[str, Any] = {
            "input_ids": ids_S.view(1, s),
            "position_ids": torch.arange(start, start + s, device=ids_S.device)[None],
            self.cache_kwarg: self.cache.hf,
            "use_cache": True,
        }
        if last_logits_only:
            # The prefill needs one row of logits, not [P, V] (GBs for a 248k vocab).
            kwargs["logits_to_keep"] = 1
        out = target_forward(self.target, kwargs, taps)
        self.cache.length += s
        self.forwards += 1
        return out

    def after_prefill(self) -> None:
        # Sliding layers keep the whole prompt until a crop trims them to the window; with
        # transformers 5.17 the next forward's mask does not fit the untrimmed cache.
        self.cache.crop_attention(0)

    def snapshot(self, block: int) -> Any:
        return self.cache.snapshot() if self.cache.has_recurrent and block > 1 else None

    def rewind(self, block_S: torch.Tensor, kept: int, snapshot: Any) -> None:
        removed = block_S.numel() - kept
        if not self.cache.has_recurrent:
            self.cache.crop_attention(removed)  # also trims sliding windows when removed == 0
            self.cache.length -= removed
            return
        if removed == 0:
            self.cache.crop_attention(0)
            return
        self.cache.restore(snapshot)
        self.cache.crop_attention(block_S.numel())
        self.cache.length -= block_S.numel()
        self.forward(block_S[:kept], taps=False, last_logits_only=True)
        self.cache.crop_attention(0)
