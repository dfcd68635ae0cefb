"""Run configuration: nested frozen dataclasses, YAML recipes, dotted overrides.

One representation end to end: a recipe (YAML) plus `section.field=value` overrides
becomes a `Config`, every field is type-checked against its annotation, and every
section validates itself in `__post_init__`. Any mistake raises `ConfigError` with the
dotted field name and the fix, because a typo that silently falls back to a default
is how multi-day runs go wrong.

The drafter section holds *knobs*; the concrete drafter geometry is derived from
the target's HF config by `dflash_trainer.core.geometry.resolve_drafter_spec`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the field and the fix."""


def _fail(path: str, msg: str) -> typing.NoReturn:
    raise ConfigError(f"{path}: {msg}")


@dataclass(frozen=True)
class TargetConfig:
    """The frozen target model."""

    name_or_path: str = "asset:smollm2-135m-instruct"
    """HF hub id, local directory, or `asset:<name>` for a bundled offline asset."""
    gguf_file: str | None = None
    """GGUF file name inside `name_or_path` (set automatically for GGUF assets)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Weights dtype of the target (fp32 is the safe choice on CPU)."""
    random_init: bool = False
    """Build the target from its config with random weights (shape/speed work only)."""
    hf_config_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields set on the target's HF config before building (e.g. num_hidden_layers for a smoke test)."""
    trust_remote_code: bool = False
    """Allow repository code to run; off by default on purpose."""
    revision: str | None = None
    """Hub revision (branch, tag or commit)."""
    attn_implementation: str = "sdpa"
    """HF attention backend of the target."""

    def __post_init__(self) -> None:
        if not self.name_or_path:
            _fail("target.name_or_path", "must name a hub id, local dir or asset:<name>")


GEOMETRY_PRESETS: dict[str, dict[str, int]] = {
    # The geometry of the published Qwen3 / Qwen3.6 DFlash drafters (Qwen3Config defaults).
    "qwen3": {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
    # A small geometry for targets with hidden sizes in the hundreds (SmolLM2, tests).
    "small": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64},
}

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class DrafterConfig:
    """Knobs of the drafter; shared dims (hidden, vocab, H_target) come from the target."""

    num_layers: int = 5
    """Number of drafter decoder layers (paper ablation: 3/5/8)."""
    block_size: int = 16
    """Tokens per drafted block B (one anchor + B-1 drafted tokens)."""
    num_target_layers: int = 5
    """How many target layers to tap when target_layer_ids is not given."""
    target_layer_ids: tuple[int, ...] | None = None
    """0-based target decoder layers whose outputs are tapped (default: the z-lab formula)."""
    mask_token_id: int | None = None
    """Embedding row used for the B-1 masked slots; must never occur in the data."""
    geometry: str | None = "qwen3"
    """Preset for heads/kv heads/head_dim (qwen3 = 32/8/128, small = 8/4/64); explicit fields win."""
    num_attention_heads: int | None = None
    """Drafter query heads (independent of the target)."""
    num_key_value_heads: int | None = None
    """Drafter KV heads (independent of the target)."""
    head_dim: int | None = None
    """Drafter head dim (independent of the target)."""
    intermediate_size: int | None = None
    """SwiGLU width; defaults to the target's intermediate_size."""
    rope_theta: float | None = None
    """RoPE base; defaults to the target's."""
    layer_types: tuple[str, ...] | None = None
    """Per layer `full_attention` or `sliding_attention` (default: all full)."""
    sliding_window: int | None = None
    """Window W of sliding layers (required when any layer slides)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon of the drafter."""
    max_position_embeddings: int | None = None
    """Recorded in exports; defaults to the target's."""
    layer_class: Literal["qwen3", "llama"] = "qwen3"
    """qwen3: head_dim is free; llama: head_dim = hidden_size / num_attention_heads."""
    init_from: str | None = None
    """Start from an exported/imported drafter directory (fine-tuning a published drafter)."""

    def __post_init__(self) -> None:
        p = "drafter"
        if self.num_layers < 1:
            _fail(f"{p}.num_layers", f"must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            _fail(
                f"{p}.block_size", f"must be >= 2 (anchor + drafted slots), got {self.block_size}"
            )
        if self.num_target_layers < 1:
            _fail(f"{p}.num_target_layers", "must be >= 1")
        if self.target_layer_ids is not None:
            ids = self.target_layer_ids
            if len(ids) == 0:
                _fail(f"{p}.target_layer_ids", "must not be empty (or leave it unset)")
            if len(set(ids)) != len(ids):
                _fail(f"{p}.target_layer_ids", f"has duplicates: {list(ids)}; each layer once")
            if min(ids) < 0:
                _fail(f"{p}.target_layer_ids", f"ids are 0-based and >= 0, got {list(ids)}")
        if self.geometry is not None and self.geometry not in GEOMETRY_PRESETS:
            _fail(
                f"{p}.geometry",
                f"unknown preset {self.geometry!r}; choose one of {sorted(GEOMETRY_PRESETS)} "
                "or set it to null and give num_attention_heads/num_key_value_heads/head_dim",
            )
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                _fail(f"{p}.{name}", f"must be >= 1, got {v}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                _fail(
                    f"{p}.layer_types",
                    f"has {len(self.layer_types)} entries but drafter.num_layers is "
                    f"{self.num_layers}; give one type per layer",
                )
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                _fail(f"{p}.layer_types", f"unknown types {bad}; use {list(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                _fail(
                    f"{p}.sliding_window",
                    "layer_types has sliding_attention layers but sliding_window is unset; "
                    "set drafter.sliding_window (e.g. 2048)",
                )
        if self.sliding_window is not None and self.sliding_window < 1:
            _fail(f"{p}.sliding_window", f"must be >= 1, got {self.sliding_window}")
        if self.rope_theta is not None and self.rope_theta <= 0:
            _fail(f"{p}.rope_theta", "must be > 0")
        if self.rms_norm_eps <= 0:
            _fail(f"{p}.rms_norm_eps", "must be > 0")

    def resolved_layer_types(self) -> tuple[str, ...]:
        return self.layer_types or ("full_attention",) * self.num_layers


@dataclass(frozen=True)
class DataConfig:
    """Where training documents come from and how they are batched."""

    train: str | None = None
    """Prepared dataset directory (manifest.json), or a raw conversation file / asset:<name>."""
    eval: str | None = None
    """Held-out prompts for in-training evaluation (prepared dir or raw file)."""
    format: Literal["auto", "sharegpt", "openai", "prompts", "tokenized"] = "auto"
    """Format of a raw `train` file."""
    max_records: int | None = None
    """Read at most this many raw records (demo runs)."""
    regenerate: bool = False
    """Replace assistant turns by the target's own answers before training."""
    regenerate_max_new_tokens: int = 256
    """Max new tokens per regenerated assistant turn."""
    token_budget: int = 8192
    """Tokens per training step (the packed length); documents are batched to fit it."""
    max_doc_tokens: int | None = None
    """Truncate documents to this many tokens (default: token_budget), counted in the log."""
    eval_fraction: float = 0.02
    """Fraction of prepared documents split off for evaluation by stable hash."""
    shuffle_seed: int = 0
    """Seed of the epoch shuffles."""

    def __post_init__(self) -> None:
        if self.token_budget < 16:
            _fail("data.token_budget", f"must be >= 16 tokens, got {self.token_budget}")
        if self.max_doc_tokens is not None and not (2 <= self.max_doc_tokens <= self.token_budget):
            _fail(
                "data.max_doc_tokens",
                f"must be between 2 and data.token_budget ({self.token_budget}), got "
                f"{self.max_doc_tokens}",
            )
        if not 0.0 <= self.eval_fraction < 1.0:
            _fail("data.eval_fraction", f"must be in [0, 1), got {self.eval_fraction}")
        if self.max_records is not None and self.max_records < 1:
            _fail("data.max_records", "must be >= 1")

    @property
    def doc_limit(self) -> int:
        return self.max_doc_tokens or self.token_budget


@dataclass(frozen=True)
class TrainingConfig:
    """Optimisation, loss and loop settings (defaults: DFLASH_SPEC.md section 6)."""

    lr: float = 6e-4
    """Peak AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to norms)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    warmup_ratio: float = 0.04
    """Fraction of total steps of linear warmup."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    grad_clip: float = 1.0
    """Max global grad norm (0 disables)."""
    epochs: float = 6.0
    """Passes over the training data."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides epochs for the schedule)."""
    grad_accum_steps: int = 1
    """Micro-steps per optimizer step."""
    max_anchors: int = 512
    """Anchors sampled per packed step."""
    noise_std: float = 0.05
    """Half-width s of the U(-s, s) noise on context features (training only)."""
    loss: Literal["ce", "kl"] = "ce"
    """Per-slot loss: cross-entropy to a hard label, or KL to the target distribution (fp32)."""
    labels: Literal["target", "data"] = "target"
    """What a slot learns: the target's own prediction, or the dataset token."""
    weighting: Literal["decay", "dpace"] = "decay"
    """Per-slot weights: exp(-(k-1)/gamma) or D-PACE confidence-weighted suffix sums."""
    gamma: float | None = None
    """Decay constant (default by block size: 16->7, 10->5, 8->4, else B/2)."""
    dpace_alpha: float = 0.5
    """Confidence smoothing of dpace."""
    loss_chunk_rows: int = 2048
    """Rows (anchor slots) per lm_head chunk: bounds the [rows, vocab] logits in memory."""
    compile: bool | None = None
    """torch.compile FlexAttention lazily on the first step (default: on with CUDA, off on CPU)."""
    precision: Literal["bf16", "fp32"] = "bf16"
    """Compute precision of the drafter (bf16 autocast with fp32 master weights)."""
    seed: int = 0
    """Seed for init, anchors and noise."""
    log_every: int = 50
    """Steps between metric logs."""
    checkpoint_every: int = 5000
    """Steps between checkpoints (plus one at the end)."""
    keep_last: int = 3
    """Checkpoints kept."""
    eval_every: int = 0
    """Steps between in-training speculative evals (0 = off)."""
    max_bad_steps: int = 5
    """Consecutive NaN/inf steps that stop the run."""
    device: str = "auto"
    """cuda, cpu, or auto."""
    pack_documents: bool = True
    """Pack many documents into one drafter forward (False: one document per forward, for benchmarks)."""
    step_path: Literal["auto", "fast", "standard"] = "auto"
    """fast: fixed shapes, target in CUDA graphs, no host waits inside a step (train/fast_step.py);
    standard: shapes follow the data; auto: fast for small full-attention targets on one GPU."""
    target_chunk_tokens: int = 16384
    """Fast step: rows x length of one target forward (one CUDA graph per row-length bucket)."""

    def __post_init__(self) -> None:
        p = "training"
        if self.lr <= 0:
            _fail(f"{p}.lr", f"must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            _fail(f"{p}.weight_decay", "must be >= 0")
        if not 0 <= self.warmup_ratio < 1:
            _fail(f"{p}.warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail(f"{p}.min_lr_ratio", "must be in [0, 1]")
        if self.grad_clip < 0:
            _fail(f"{p}.grad_clip", "must be >= 0 (0 disables clipping)")
        if self.epochs <= 0:
            _fail(f"{p}.epochs", "must be > 0")
        if self.max_steps is not None and self.max_steps < 1:
            _fail(f"{p}.max_steps", "must be >= 1")
        if self.grad_accum_steps < 1:
            _fail(f"{p}.grad_accum_steps", "must be >= 1")
        if self.max_anchors < 1:
            _fail(f"{p}.max_anchors", "must be >= 1")
        if self.noise_std < 0:
            _fail(f"{p}.noise_std", "must be >= 0 (0 disables noise)")
        if self.gamma is not None and self.gamma <= 0:
            _fail(f"{p}.gamma", "must be > 0")
        if not 0 <= self.dpace_alpha <= 1:
            _fail(f"{p}.dpace_alpha", "must be in [0, 1]")
        if self.weighting == "dpace" and self.loss != "ce":
            _fail(
                f"{p}.weighting",
                "dpace weights are defined from cross-entropy confidences; set training.loss=ce "
                "or training.weighting=decay",
            )
        if self.loss == "kl" and self.labels == "data":
            _fail(
                f"{p}.loss",
                "kl needs the target's distribution; with training.labels=data use loss=ce",
            )
        if self.loss_chunk_rows < 1:
            _fail(f"{p}.loss_chunk_rows", "must be >= 1")
        for name in ("log_every", "checkpoint_every", "keep_last", "max_bad_steps"):
            if getattr(self, name) < 1:
                _fail(f"{p}.{name}", "must be >= 1")
        if self.eval_every < 0:
            _fail(f"{p}.eval_every", "must be >= 0 (0 disables)")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            _fail(f"{p}.device", f"use auto, cpu, cuda or cuda:N, got {self.device!r}")

    def resolved_gamma(self, block_size: int) -> float:
        if self.gamma is not None:
            return self.gamma
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2)


@dataclass(frozen=True)
class RunConfig:
    """Where the run lives."""

    output_dir: str = "runs/dflash"
    """Run directory (config, metrics, checkpoints, plots); local path or fsspec URL for checkpoints."""
    checkpoint_dir: str | None = None
    """Checkpoint location if not <output_dir>/checkpoints (e.g. s3://bucket/run)."""
    name: str | None = None
    """Human name of the run (defaults to the output dir name)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for a remote checkpoint_dir (e.g. endpoint_url, key, secret for s3://)."""


@dataclass(frozen=True)
class DistributedConfig:
    """Placement and data parallelism (see docs/multi-gpu.md)."""

    placement: Literal["colocated", "pairs"] = "colocated"
    """colocated: target and drafter on each rank's GPU; pairs: target GPU + drafter GPU per rank."""
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    """How the drafter is replicated over ranks."""
    target_sharding: Literal["replicate", "fsdp", "device_map"] = "replicate"
    """Frozen target: one copy per rank; fsdp: 1/world of each decoder layer per rank (colocated,
    torchrun; one rank: as replicate); device_map: one process's target spread over its GPUs."""
    tensor_parallel_size: int = 1
    """Serving TP size to check head divisibility against (doctor only)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            _fail("distributed.tensor_parallel_size", "must be >= 1")
        if self.target_sharding == "fsdp" and self.placement == "pairs":
            # pairs runs the target in a background thread while the main thread runs
            # the drafter's collectives: the two streams of collectives could interleave
            # differently on different ranks and hang.
            _fail(
                "distributed.target_sharding",
                "fsdp needs placement=colocated (pairs runs the target in a thread beside "
                "the drafter's collectives); use target_sharding=device_map with pairs",
            )


@dataclass(frozen=True)
class EvalConfig:
    """Speculative-decoding evaluation settings."""

    prompts: tuple[str, ...] = ("gsm8k",)
    """Prompt sets: gsm8k, mt-bench, humaneval, or paths to JSONL prompt files."""
    max_samples: int | None = 32
    """Prompts per set."""
    max_new_tokens: int = 256
    """Tokens generated per response."""
    temperature: float = 0.0
    """0 = greedy (lossless check), > 0 = exact sampling."""
    top_p: float = 1.0
    """Nucleus sampling of the target when temperature > 0."""
    seed: int = 0
    """Sampling seed."""
    enable_thinking: bool = False
    """Pass enable_thinking to chat templates that support it."""
    train_eval_samples: int = 8
    """Prompts used by the in-training eval."""
    train_walk_docs: int = 16
    """Held-out documents walked by the in-training eval (walk_eval.py); 0 turns it off."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            _fail("eval.temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            _fail("eval.top_p", "must be in (0, 1]")
        if self.max_new_tokens < 1:
            _fail("eval.max_new_tokens", "must be >= 1")
        if self.train_walk_docs < 0:
            _fail("eval.train_walk_docs", "must be >= 0 (0 turns the held-out walk off)")


@dataclass(frozen=True)
class Config:
    """A whole run."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# ---------------------------------------------------------------- building from dicts


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against annotation `tp`, converting lists to tuples and ints to floats."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            _fail(path, "must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        _fail(path, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            _fail(path, f"must be one of {list(choices)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            _fail(path, f"expected a list, got {value!r}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            _fail(path, f"expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            _fail(path, f"expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            _fail(path, f"expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            _fail(path, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads `3e-4` (no dot) as a string; accept what a user means.
            try:
                return float(value)
            except ValueError:
                _fail(path, f"expected a number, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(path, f"expected a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported annotation {tp!r} at {path}")


def _build(cls: type, data: dict[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"{path}." if path else ""
        _fail(
            f"{where}{unknown[0]}",
            f"unknown key; valid keys of {path or 'the config'} are {names}",
        )
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from a nested mapping."""
    result: Config = _build(Config, data, "")
    return result


def config_to_dict(cfg: Any) -> Any:
    """Plain nested dict (lists instead of tuples) suitable for YAML/JSON."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple | list):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a nested dict copy."""
    out = yaml.safe_load(yaml.safe_dump(data)) or {}
    section_names = {f.name: f.type for f in dataclasses.fields(Config)}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r}: expected section.field=value, e.g. training.lr=3e-4"
            )
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or parts[0] not in section_names:
            raise ConfigError(
                f"override {item!r}: the key must start with a section "
                f"({', '.join(section_names)}), e.g. training.lr=3e-4"
            )
        value = yaml.safe_load(raw) if raw.strip() else None
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
                node[part] = child
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def recipe_names() -> list[str]:
    root = resources.files("dflash_trainer") / "recipes"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def recipe_path(name: str) -> Path:
    root = resources.files("dflash_trainer") / "recipes"
    path = Path(str(root / f"{name}.yaml"))
    if not path.is_file():
        raise ConfigError(f"unknown recipe {name!r}; available recipes: {recipe_names()}")
    return path


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return data


def load_config(
    recipe: str | None = None, config_file: str | None = None, overrides: list[str] | None = None
) -> Config:
    """Recipe or file (not both), then dotted overrides, then validation."""
    if recipe and config_file:
        raise ConfigError("give either --recipe or --config, not both")
    data: dict[str, Any] = {}
    if recipe:
        data = load_yaml(recipe_path(recipe))
    elif config_file:
        data = load_yaml(config_file)
    data = apply_overrides(data, list(overrides or []))
    return config_from_dict(data)


def replace(cfg: Config, **sections: Any) -> Config:
    """dataclasses.replace over sections: replace(cfg, training={'lr': 1e-3})."""
    updates = {}
    for name, changes in sections.items():
        updates[name] = dataclasses.replace(getattr(cfg, name), **changes)
    return dataclasses.replace(cfg, **updates)
