"""The frozen target: load, tap layers with hooks, right-padded forward, logits on demand.

Shape legend: D = documents in a batch, L = padded length, T = packed tokens,
H = target hidden, F = n_tapped * H, R = rows that need target logits.

- Taps are forward hooks on the chosen decoder layers: only those outputs are kept
  (never all L hidden states). A hook's output is HF's `hidden_states[l + 1]`.
- Batches are RIGHT-padded with explicit per-row positions from 0: a causal or
  recurrent layer (Gated DeltaNet) then never sees another document or left padding,
  so a document's features do not depend on its batch mates.
- The final normed hidden state is kept per token (a [T, H] tensor, small), and
  lm_head runs only on the R rows the loss needs, in chunks.
- When nothing needs the final layer (labels from the data), the forward stops
  right after the deepest tapped layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_trainer.config import TargetConfig
from dflash_trainer.errors import DFlashError

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _StopForward(Exception):
    """Raised by the deepest tap when the rest of the target is not needed."""


def load_target_model(tcfg: TargetConfig, device: str | torch.device = "cpu") -> Any:
    """An HF causal LM, frozen and in eval mode, on `device`."""
    from transformers import AutoModelForCausalLM

    from dflash_trainer.hf_configs import load_target_config, target_source

    dtype = _DTYPES[tcfg.dtype]
    if tcfg.random_init:
        cfg = load_target_config(tcfg)
        torch.manual_seed(0)
        with torch.device(device):
            model: Any = AutoModelForCausalLM.from_config(
                cfg, dtype=dtype, trust_remote_code=tcfg.trust_remote_code
            )
    else:
        name, gguf = target_source(tcfg)
        kw: dict[str, Any] = {
            "dtype": dtype,
            "trust_remote_code": tcfg.trust_remote_code,
            "attn_implementation": tcfg.attn_implementation,
        }
        if gguf:
            kw["gguf_file"] = gguf
        if tcfg.revision:
            kw["revision"] = tcfg.revision
        try:
            model = AutoModelForCausalLM.from_pretrained(name, **kw)
        except (OSError, ValueError) as e:
            raise DFlashError(
                f"target.name_or_path={tcfg.name_or_path!r}: cannot load the model ({e})"
            ) from e
        for key, value in tcfg.hf_config_overrides.items():
            setattr(model.config, key, value)
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def decoder_layers(model: Any) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise DFlashError(
            f"{type(model).__name__}: cannot find its decoder layers (model.model.layers); "
            "this target architecture is not supported yet"
        )
    return layers


@dataclass
class TargetBatch:
    """Packed outputs of one target forward (documents in the order given)."""

    features_TF: torch.Tensor
    """Tapped layer outputs concatenated along features (target dtype)."""
    final_hidden_TH: torch.Tensor | None
    """Final normed hidden state per token (None when not needed)."""
    lengths: list[int]


class FrozenTarget:
    """A frozen HF causal LM with hooks on `layer_ids` (0-based decoder layers)."""

    def __init__(self, model: Any, layer_ids: Sequence[int]) -> None:
        self.model: Any = model
        self.layer_ids = list(layer_ids)
        self.layers = decoder_layers(model)
        n = len(self.layers)
        bad = [i for i in self.layer_ids if not 0 <= i < n]
        if bad:
            raise DFlashError(f"target_layer_ids {bad} out of range for a {n}-layer target")
        self.decoder: Any = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self._captured: dict[int, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def embed_tokens(self) -> nn.Module:
        emb = self.model.get_input_embeddings()
        assert isinstance(emb, nn.Module)
        return emb

    @property
    def lm_head_weight(self) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        assert isinstance(head, nn.Linear)
        return head.weight.detach()

    @contextlib.contextmanager
    def taps(self, stop_after_last: bool = False) -> Iterator[dict[int, torch.Tensor]]:
        """Capture the tapped layers' outputs while the context is open."""
        captured: dict[int, torch.Tensor] = {}
        last = max(self.layer_ids)

        def hook(idx: int) -> Any:
            def fn(_m: nn.Module, _inp: Any, out: Any) -> None:
                captured[idx] = out[0] if isinstance(out, tuple) else out
                if stop_after_last and idx == last:
                    raise _StopForward

            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in self.layer_ids]
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()

    def features_of(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1)

    @torch.no_grad()
    def forward_documents(
        self, docs: Sequence[torch.Tensor], need_final: bool = True
    ) -> TargetBatch:
        """Right-padded forward of whole documents; outputs packed in the given order."""
        lengths = [int(d.numel()) for d in docs]
        dev = self.device
        width = max(lengths)
        ids = torch.zeros(len(docs), width, dtype=torch.long, device=dev)
        attn = torch.zeros(len(docs), width, dtype=torch.long, device=dev)
        for i, d in enumerate(docs):
            ids[i, : lengths[i]] = d.to(dev)
            attn[i, : lengths[i]] = 1
        pos = torch.arange(width, device=dev)[None].expand(len(docs), width)
        final = None
        with self.taps(stop_after_last=not need_final) as cap:
            try:
                out = self.decoder(
                    input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False
                )
                final = out.last_hidden_state if need_final else None
            except _StopForward:
                pass
            feats = self.features_of(cap)
        keep = attn.bool()
        return TargetBatch(
            features_TF=feats[keep],
            final_hidden_TH=final[keep] if final is not None else None,
            lengths=lengths,
        )

    @torch.no_grad()
    def argmax_at(self, final_hidden_RH: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
        """Target greedy prediction from final hidden rows, lm_head chunked."""
        w = self.lm_head_weight
        out = torch.empty(final_hidden_RH.shape[0], dtype=torch.long, device=w.device)
        for s in range(0, final_hidden_RH.shape[0], chunk_rows):
            rows = final_hidden_RH[s : s + chunk_rows].to(w.device, w.dtype)
            out[s : s + chunk_rows] = (rows @ w.t()).argmax(-1)
        return out

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.embed_tokens(ids.to(self.device))
        assert isinstance(out, torch.Tensor)
        return out
