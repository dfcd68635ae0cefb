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
  right after the deepest tapped layer (not when FSDP-sharded, see forward_documents).

Placement (docs/multi-gpu.md): one copy per rank; FSDP2-sharded decoder layers
(distributed.apply_target_sharding), where every forward is a collective and ranks
pad their forward count to the same number; or spread over one process's GPUs with an
accelerate device_map (`spread_over_gpus`), where outputs are gathered on the first
device.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash_trainer import gguf_cache
from dflash_trainer.config import TargetConfig
from dflash_trainer.errors import DFlashError, about
from dflash_trainer.formats.safetensors_check import check_model_weights
from dflash_trainer.model_dir_check import check_model_files

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@contextlib.contextmanager
def attending_with(model: Any, name: str, fn: Any) -> Iterator[None]:
    """While open, `model`'s attention layers call `fn`, registered with transformers as
    `name` (its layers look their attention function up by the config's implementation name
    at every call); the implementation it had is restored after."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    cfg = model.config
    before = cfg._attn_implementation
    cfg._attn_implementation = name
    try:
        yield
    finally:
        cfg._attn_implementation = before


class _StopForward(Exception):
    """Raised by the deepest tap when the rest of the target is not needed."""


def load_target_model(
    tcfg: TargetConfig,
    device: str | torch.device = "cpu",
    max_memory: dict[int, int] | None = None,
) -> Any:
    """An HF causal LM, frozen and in eval mode, on `device`.

    max_memory (GPU index -> bytes): load on the host, then spread whole decoder layers
    over those GPUs (target_sharding=device_map); `device` is then ignored.
    """
    if tcfg.precision == "fp8":
        _check_fp8_devices(device, max_memory)  # before minutes of loading
    if max_memory is not None:
        device = "cpu"
    # An FP8 target on one device is built on the host and moved a layer at a time, each
    # quantized on arrival: the device never holds the whole bf16 model (quantize_onto).
    layerwise_fp8 = tcfg.precision == "fp8" and max_memory is None
    final_device, device = device, "cpu" if layerwise_fp8 else device
    from transformers import AutoModelForCausalLM

    from dflash_trainer.target.configs import (
        allow_remote_code,
        check_shape_overrides,
        load_target_config,
    )

    dtype = _DTYPES[tcfg.dtype]
    trust = allow_remote_code(tcfg)
    cfg: Any = None
    if tcfg.random_init or tcfg.hf_config_overrides:
        # The overrides are checked against the config class before any weight exists.
        cfg = load_target_config(tcfg)
    if tcfg.random_init:
        torch.manual_seed(0)
        with torch.device(device):
            model: Any = AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=trust)
    else:
        model = _pretrained(tcfg, dtype, trust)
        check_shape_overrides(model, cfg, tcfg.hf_config_overrides)
        for key in tcfg.hf_config_overrides:  # the values checked (and typed) above
            setattr(model.config, key, getattr(cfg, key))
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    if max_memory is not None:
        model = spread_over_gpus(model, max_memory)
    if layerwise_fp8:
        from dflash_trainer.target.fp8 import quantize_onto

        report = quantize_onto(model, decoder_layers(model), final_device)
        print(f"[dflash] {report.summary()}", file=sys.stderr, flush=True)
    elif tcfg.precision == "fp8":
        from dflash_trainer.target.fp8 import quantize_linears

        # On the GPUs the layers sit on: quantizing is a pass over the weights there.
        report = quantize_linears(model, decoder_layers(model))
        print(f"[dflash] {report.summary()}", file=sys.stderr, flush=True)
    return model


def _pretrained(tcfg: TargetConfig, dtype: torch.dtype, trust: bool) -> Any:
    """The target's trained weights (a local GGUF through the unpacked copy of gguf_cache)."""
    from transformers import AutoModelForCausalLM

    from dflash_trainer.target.configs import target_source

    name, gguf = target_source(tcfg)
    kw: dict[str, Any] = {
        "dtype": dtype,
        "trust_remote_code": trust,
        "attn_implementation": tcfg.attn_implementation,
    }
    if gguf:
        kw["gguf_file"] = gguf
    if tcfg.revision:
        kw["revision"] = tcfg.revision
    check_model_files(name, "target.name_or_path")
    check_model_weights(name)
    try:
        with about(f"the model target.name_or_path={tcfg.name_or_path!r}"):
            if gguf and gguf_cache.is_local(name, gguf):
                return gguf_cache.causal_lm(
                    name, gguf, dtype, attn_implementation=tcfg.attn_implementation
                )
            return AutoModelForCausalLM.from_pretrained(name, **kw)
    except (OSError, ValueError) as e:
        raise DFlashError(
            f"target.name_or_path={tcfg.name_or_path!r}: cannot load the model ({e})"
        ) from e


def _check_fp8_devices(device: str | torch.device, max_memory: dict[int, int] | None) -> None:
    from dflash_trainer.target.fp8 import fp8_mode

    for dev in [f"cuda:{i}" for i in max_memory] if max_memory is not None else [device]:
        fp8_mode(dev)


def spread_over_gpus(model: Any, max_memory: dict[int, int]) -> Any:
    """Place whole decoder layers over the GPUs of `max_memory` (accelerate's device_map).

    Balanced, not filled in order, so no GPU (the drafter's among them) takes more than
    its share; accelerate's hooks move activations from one GPU to the next. A target
    that does not fit the GPUs is refused rather than offloaded to the host, which would
    make every step copy its weights over PCIe.
    """
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    balanced = get_balanced_memory(
        model, max_memory=dict(max_memory), no_split_module_classes=no_split
    )
    device_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split)
    off_gpu = sorted({str(d) for d in device_map.values() if not isinstance(d, int)})
    if off_gpu:
        gb = {i: round(b / 1e9, 1) for i, b in max_memory.items()}
        raise DFlashError(
            f"distributed.target_sharding=device_map: the target does not fit the GPUs "
            f"(budget per GPU in GB: {gb}; it would need {off_gpu}); use more GPUs, or "
            "target_sharding=fsdp under torchrun"
        )
    return dispatch_model(model, device_map)


def decoder_of(model: Any) -> Any:
    """The decoder stack (embeddings, layers, final norm) under the LM head."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def decoder_layers(model: Any) -> nn.ModuleList:
    layers = getattr(decoder_of(model), "layers", None)
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
        self.decoder: Any = decoder_of(model)
        self._captured: dict[int, torch.Tensor] = {}
        from torch.distributed.fsdp import FSDPModule

        # Derived from the model, not configured: distributed.apply_target_sharding wraps
        # the layers (with one rank it leaves the target whole).
        self.sharded = isinstance(self.layers[0], FSDPModule)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def num_params(self) -> int:
        """The target's weights, counting an FP8 target's quantized weights (buffers)."""
        n = sum(p.numel() for p in self.model.parameters())
        return n + sum(b.numel() for b in self.model.buffers() if b.dtype == torch.float8_e4m3fn)

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
        # Under a device_map the tapped layers may sit on different GPUs.
        dev = captured[self.layer_ids[0]].device
        return torch.cat([captured[i].to(dev) for i in self.layer_ids], dim=-1)

    def forward_calls(self, n_local: int) -> int:
        """Forwards this rank must make to run its `n_local` micro-batches.

        A sharded target's forward is a collective (one all-gather per layer), so every
        rank makes as many forwards as the rank with the most micro-batches, the others
        padding with `idle_forward`. The count is agreed before any forward runs: an
        all-reduce issued after one would meet another rank's all-gather.
        """
        if not self.sharded:
            return n_local
        n = torch.tensor([n_local], device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return int(n.item())

    def idle_forward(self) -> None:
        """A one-token forward whose outputs are dropped: takes part in the all-gathers."""
        self.forward_documents([torch.zeros(1, dtype=torch.long)], need_final=False)

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
        # Sharded, the forward runs to the end: an exception leaving the FSDP root skips
        # its post-forward hook and leaves FSDP's per-forward state half done. (The
        # deepest tap is usually near the top, so little is lost.)
        with self.taps(stop_after_last=not need_final and not self.sharded) as cap:
            try:
                out = self.decoder(
                    input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False
                )
                final = out.last_hidden_state.to(dev) if need_final else None
            except _StopForward:
                pass
            feats = self.features_of(cap).to(dev)
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
