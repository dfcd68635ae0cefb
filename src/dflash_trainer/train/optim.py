"""AdamW with fp32 master weights and state, linear warmup then cosine.

The drafter's parameters stay fp32 (they are the master weights); compute runs under
bf16 autocast, so there is no separate master copy to keep in sync. Weight decay
skips norms (1-D tensors), as is standard for transformer blocks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dflash_trainer.config import TrainingConfig


def build_optimizer(model: nn.Module, t: TrainingConfig) -> torch.optim.AdamW:
    # Groups keyed by (selector?, decayed?). The DFlash2 selector starts as an exact no-op
    # (zero successor codebook: the predecessor codebook and gate get no gradient until it
    # moves), and Adam moves a parameter about lr per step, so at a backbone's lr its pair
    # term stays far below the logit gaps it has to reorder for hundreds of steps. Only the
    # selector: the convolutions sit in the residual stream, where a large step would
    # disturb a trained backbone, and they get gradient from the first step anyway.
    scale = t.selector_lr_scale
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        fresh = scale != 1.0 and _plain_name(name).startswith("candidate_selector.")
        groups.setdefault((fresh, p.ndim >= 2), []).append(p)
    params = [p for ps in groups.values() for p in ps]
    built = [
        {
            "params": ps,
            "weight_decay": t.weight_decay if decayed else 0.0,
            "lr": t.lr * (scale if fresh else 1.0),
        }
        for (fresh, decayed), ps in sorted(groups.items(), key=lambda kv: (kv[0][0], not kv[0][1]))
    ]
    if not built:  # AdamW refuses an empty list; the caller's own check names the problem
        built = [{"params": [], "weight_decay": t.weight_decay, "lr": t.lr}]
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(built, lr=t.lr, betas=t.betas, eps=1e-8, fused=fused or None)


def _plain_name(name: str) -> str:
    """A parameter's name without the prefixes torch.compile, DDP and FSDP wrap it in."""
    for prefix in ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    opt: torch.optim.Optimizer, t: TrainingConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = math.ceil(t.warmup_ratio * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total_steps, warmup, t.min_lr_ratio)
    )


# Checkpoints store optimizer state without pickles: tensors to safetensors, the rest JSON.
def flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    # Keys are parameter indices (plain optimizers) or names with dots (FSDP full state
    # dicts): "/" separates them from the state field, and the key kind is recorded.
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    int_keys = all(isinstance(k, int) for k in sd["state"])
    for idx, st in sd["state"].items():
        for key, val in st.items():
            if torch.is_tensor(val):
                tensors[f"state/{idx}/{key}"] = val.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = val
    meta = {"param_groups": sd["param_groups"], "scalars": scalars, "int_keys": int_keys}
    return tensors, meta


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    as_key: Any = int if meta.get("int_keys", True) else str
    state: dict[Any, dict[str, Any]] = {}
    for name, t in tensors.items():
        head, key = name.rsplit("/", 1)
        state.setdefault(as_key(head.split("/", 1)[1]), {})[key] = t
    for idx, vals in meta.get("scalars", {}).items():
        state.setdefault(as_key(idx), {}).update(vals)
    return {"state": state, "param_groups": meta["param_groups"]}
