"""The sections of a run config: frozen dataclasses whose fields declare their rules.

Every field is declared with `setting(default, lo=, hi=, ...)` (config_fields.py): the
type comes from the annotation, the allowed range from the rule, and `check_section`
checks both on construction. `__post_init__` adds only what involves several fields.
Upper bounds are sanity limits: far above any real run, low enough that a typo
(an extra zero, a wrong unit) is refused in milliseconds instead of allocating
hundreds of GiB or building for minutes before failing.

The drafter section holds *knobs*; the concrete drafter geometry is derived from
the target's HF config by `dflash_trainer.core.geometry.resolve_drafter_spec`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_trainer.config_fields import SEED_MAX, Rule, check_section, fail, setting

GEOMETRY_PRESETS: dict[str, dict[str, int]] = {
    # The geometry of the published Qwen3 / Qwen3.6 DFlash drafters (Qwen3Config defaults).
    "qwen3": {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
    # A small geometry for targets with hidden sizes in the hundreds (SmolLM2, tests).
    "small": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64},
}

LAYER_TYPES = ("full_attention", "sliding_attention")

BIG = 2**40  # step and record counts: any real run is far below
MAX_TOKENS = 2**18  # 262144 tokens per packed step
_TOKENS_WHY = (
    "a sanity bound: the packed step's activations grow with it, and a few hundred "
    "thousand tokens already need tens of GiB; split the work with grad_accum_steps"
)
_SEED = {"lo": 0, "hi": SEED_MAX, "why": "seeds are unsigned 63-bit integers"}
_COUNT = {"lo": 1, "hi": BIG}


@dataclass(frozen=True)
class TargetConfig:
    """The frozen target model."""

    name_or_path: str = setting("asset:smollm2-135m-instruct", min_len=1, max_len=4096)
    """HF hub id, local directory, or `asset:<name>` for a bundled offline asset."""
    gguf_file: str | None = setting(None, min_len=1, file_name=True)
    """GGUF file name inside `name_or_path` (set automatically for GGUF assets)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Compute dtype of the target, and its weights' unless precision=fp8 (fp32 is the safe choice on CPU)."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """fp8: the decoder layers' linears in float8 e4m3, quantized once at load (half the weight
    memory, FP8 matmuls; a CUDA GPU of compute capability >= 8.9; docs/fp8-target.md)."""
    random_init: bool = False
    """Build the target from its config with random weights (shape/speed work only)."""
    hf_config_overrides: dict[str, Any] = field(
        default_factory=dict, metadata={"rule": Rule(identifier_keys=True)}
    )
    """Fields set on the target's HF config before building (e.g. num_hidden_layers for a smoke test)."""
    trust_remote_code: bool = False
    """Allow repository code to run; also needs `--trust-remote-code` on the command line."""
    revision: str | None = setting(None, min_len=1)
    """Hub revision (branch, tag or commit)."""
    attn_implementation: str = setting("sdpa", min_len=1)
    """HF attention backend of the target."""

    def __post_init__(self) -> None:
        check_section(self, "target")
        if self.precision == "fp8" and self.dtype != "bfloat16":
            fail(
                "target.precision",
                f"fp8 computes in bfloat16 (the FP8 matmuls return bf16), but target.dtype is "
                f"{self.dtype}; set target.dtype=bfloat16 or target.precision=bf16",
            )


@dataclass(frozen=True)
class DrafterConfig:
    """Knobs of the drafter; shared dims (hidden, vocab, H_target) come from the target."""

    num_layers: int = setting(5, lo=1, hi=64, why="published drafters use 1-8 layers")
    """Number of drafter decoder layers (paper ablation: 3/5/8)."""
    block_size: int = setting(16, lo=2, hi=256, why="anchor + drafted slots")
    """Tokens per drafted block B (one anchor + B-1 drafted tokens)."""
    num_target_layers: int = setting(5, lo=1, hi=256)
    """How many target layers to tap when target_layer_ids is not given."""
    target_layer_ids: tuple[int, ...] | None = setting(
        None, min_len=1, max_len=256, item=Rule(lo=0, hi=4095, why="0-based decoder layers")
    )
    """0-based target decoder layers whose outputs are tapped (default: the z-lab formula)."""
    mask_token_id: int | None = setting(None, lo=0, hi=2**31 - 1)
    """Embedding row used for the B-1 masked slots; must never occur in the data."""
    geometry: str | None = setting("qwen3", choices=tuple(GEOMETRY_PRESETS))
    """Preset for heads/kv heads/head_dim (qwen3 = 32/8/128, small = 8/4/64); explicit fields win."""
    num_attention_heads: int | None = setting(None, lo=1, hi=1024)
    """Drafter query heads (independent of the target)."""
    num_key_value_heads: int | None = setting(None, lo=1, hi=1024)
    """Drafter KV heads (independent of the target)."""
    head_dim: int | None = setting(None, lo=1, hi=1024)
    """Drafter head dim (independent of the target)."""
    intermediate_size: int | None = setting(None, lo=1, hi=2**18)
    """SwiGLU width; defaults to the target's intermediate_size."""
    rope_theta: float | None = setting(None, lo=0, lo_open=True, hi=1e12)
    """RoPE base; defaults to the target's."""
    layer_types: tuple[str, ...] | None = setting(None, item=Rule(choices=LAYER_TYPES))
    """Per layer `full_attention` or `sliding_attention` (default: all full)."""
    sliding_window: int | None = setting(None, lo=1, hi=2**24)
    """Window W of sliding layers (required when any layer slides)."""
    rms_norm_eps: float = setting(1e-6, lo=0, lo_open=True, hi=1, hi_open=True)
    """RMSNorm epsilon of the drafter."""
    max_position_embeddings: int | None = setting(None, lo=1, hi=2**24)
    """Recorded in exports; defaults to the target's."""
    layer_class: Literal["qwen3", "llama"] = "qwen3"
    """qwen3: head_dim is free; llama: head_dim = hidden_size / num_attention_heads."""
    init_from: str | None = setting(None, min_len=1, path=True)
    """Start from an exported/imported drafter directory (fine-tuning a published drafter, or a
    DFlash2 drafter from a trained DFlash one: its new modules start as exact no-ops)."""
    kind: Literal["dflash", "dflash2"] = "dflash"
    """dflash: the block drafter; dflash2: the same backbone plus a grouped dynamic convolution
    around each attention and MLP sublayer and a candidate selector (docs/algorithm.md)."""
    conv_kernel_size: int = setting(2, lo=1, hi=256, why="taps: the slot itself + earlier slots")
    """DFlash2: taps of each convolution (2 = the slot and the one before it, in its block)."""
    conv_group_size: int = setting(16, lo=1, hi=2**16)
    """DFlash2: channels sharing one content-dependent coefficient (must divide hidden_size)."""
    selector_rank: int = setting(256, lo=1, hi=2**14)
    """DFlash2: width of the selector's two token codebooks and of its hidden projection."""
    selector_top_k: int = setting(16, lo=1, hi=2**12)
    """DFlash2: candidates per drafted slot that the selector chooses among."""
    selector_codebooks: Literal["tables", "embedding"] = "tables"
    """DFlash2, in training: tables trains the selector's two [vocab, rank] codebooks freely;
    embedding trains them as the target's input embedding times two [hidden, rank] matrices,
    which shares what one token pair teaches with similar tokens. Files hold tables either way."""

    def __post_init__(self) -> None:
        check_section(self, "drafter")
        ids = self.target_layer_ids
        if ids is not None and len(set(ids)) != len(ids):
            fail("drafter.target_layer_ids", f"has duplicates: {list(ids)}; each layer once")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                fail(
                    "drafter.layer_types",
                    f"has {len(self.layer_types)} entries but drafter.num_layers is "
                    f"{self.num_layers}; give one type per layer",
                )
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                fail(
                    "drafter.sliding_window",
                    "layer_types has sliding_attention layers but sliding_window is unset; "
                    "set drafter.sliding_window (e.g. 2048)",
                )

        if self.kind == "dflash2" and self.conv_kernel_size > self.block_size:
            fail(
                "drafter.conv_kernel_size",
                f"{self.conv_kernel_size} taps exceed drafter.block_size={self.block_size}: a "
                "tap never reaches outside its block; use at most block_size taps (default 2)",
            )
        if self.kind != "dflash2" and self.selector_codebooks != "tables":
            fail(
                "drafter.selector_codebooks",
                "only a DFlash2 drafter has a selector; set drafter.kind=dflash2 or drop it",
            )

    def resolved_layer_types(self) -> tuple[str, ...]:
        return self.layer_types or ("full_attention",) * self.num_layers


@dataclass(frozen=True)
class SourceConfig:
    """One prompt source of a mixture (`dflash data prompts`; docs/data.md, "Prompt sources")."""

    name: str = setting(min_len=1)
    """Prefix of the record ids (`<name>/<id>`); letters, digits, `_`, `-`, `.`."""
    path: str = setting(min_len=1)
    """A file (.json/.jsonl/.ndjson, optionally .gz), `pkg:<package>/<path>` or `asset:<name>`."""
    prompt: str | None = setting(None, min_len=1)
    """Field holding one user prompt (a string)."""
    messages: str | None = setting(None, min_len=1)
    """Field holding a conversation: {role, content} turns, alternating strings or chitchat groups."""
    template: str | None = setting(None, min_len=1)
    """One user prompt built from string fields, e.g. "{passage}\\n\\n{question}"."""
    weight: float = setting(1.0, lo=0, lo_open=True, hi=1e6)
    """Share of this source in every prefix of the mixed file (relative to the other weights)."""
    cap: int | None = setting(None, lo=1, hi=2**40)
    """Keep at most this many records of the source (a seeded random subset)."""

    def __post_init__(self) -> None:
        p = f"data.sources.{self.name}"
        check_section(self, p)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name):
            fail(f"{p}.name", "use letters, digits, '_', '-' or '.' (it prefixes record ids)")
        given = [k for k in ("prompt", "messages", "template") if getattr(self, k) is not None]
        if len(given) > 1:
            fail(f"{p}.{given[1]}", f"give one of prompt, messages, template (got {given})")


@dataclass(frozen=True)
class DataConfig:
    """Where training documents come from and how they are batched."""

    train: str | None = setting(None, min_len=1, path=True)
    """Prepared dataset directory (manifest.json), or a raw conversation file / asset:<name>."""
    eval: str | None = setting(None, min_len=1, path=True)
    """Held-out prompts for in-training evaluation (prepared dir or raw file)."""
    format: Literal["auto", "sharegpt", "openai", "prompts", "tokenized"] = "auto"
    """Format of a raw `train` file."""
    max_records: int | None = setting(None, **_COUNT)
    """Read at most this many raw records (demo runs)."""
    regenerate: bool = False
    """Replace assistant turns by the target's own answers before training."""
    regenerate_max_new_tokens: int = setting(256, lo=1, hi=MAX_TOKENS)
    """Max new tokens per regenerated assistant turn."""
    token_budget: int = setting(8192, lo=16, hi=MAX_TOKENS, why=_TOKENS_WHY)
    """Tokens per training step (the packed length); documents are batched to fit it."""
    max_doc_tokens: int | None = setting(None, lo=2, hi=MAX_TOKENS, why=_TOKENS_WHY)
    """Truncate documents to this many tokens (default: token_budget), counted in the log."""
    eval_fraction: float = setting(0.02, lo=0, hi=1, hi_open=True)
    """Fraction of prepared documents split off for evaluation by stable hash."""
    loop_tails: Literal["keep", "mask"] = "keep"
    """mask: stop supervising the repeating tail of answers that loop (data/loop_tails.py)."""
    shuffle_seed: int = setting(0, **_SEED)
    """Seed of the epoch shuffles."""
    sources: tuple[SourceConfig, ...] = setting((), max_len=1024)
    """Prompt sources mixed by `dflash data prompts --sources` (decontaminated, capped, weighted)."""

    def __post_init__(self) -> None:
        check_section(self, "data")
        if self.max_doc_tokens is not None and self.max_doc_tokens > self.token_budget:
            fail(
                "data.max_doc_tokens",
                f"must be between 2 and data.token_budget ({self.token_budget}), got "
                f"{self.max_doc_tokens}",
            )

    @property
    def doc_limit(self) -> int:
        return self.max_doc_tokens or self.token_budget


_BETA = Rule(lo=0, hi=1, hi_open=True, why="AdamW's moment decay")


@dataclass(frozen=True)
class TrainingConfig:
    """Optimisation, loss and loop settings (defaults: docs/algorithm.md)."""

    lr: float = setting(6e-4, lo=0, lo_open=True, hi=1)
    """Peak AdamW learning rate."""
    weight_decay: float = setting(0.01, lo=0, hi=10)
    """AdamW weight decay (not applied to norms)."""
    betas: tuple[float, float] = setting((0.9, 0.95), item=_BETA)
    """AdamW betas."""
    warmup_ratio: float = setting(0.04, lo=0, hi=1, hi_open=True)
    """Fraction of total steps of linear warmup."""
    min_lr_ratio: float = setting(0.0, lo=0, hi=1)
    """Cosine floor as a fraction of lr."""
    grad_clip: float = setting(1.0, lo=0, hi=1e6, why="0 disables clipping")
    """Max global grad norm (0 disables)."""
    epochs: float = setting(6.0, lo=0, lo_open=True, hi=1e6)
    """Passes over the training data."""
    max_steps: int | None = setting(None, **_COUNT)
    """Stop after this many optimizer steps (overrides epochs for the schedule)."""
    grad_accum_steps: int = setting(1, lo=1, hi=2**16)
    """Micro-steps per optimizer step."""
    max_anchors: int = setting(512, lo=1, hi=2**14, why="anchors x block_size rows per step")
    """Anchors sampled per packed step."""
    noise_std: float = setting(0.05, lo=0, hi=100, why="0 disables noise")
    """Half-width s of the U(-s, s) noise on context features (training only)."""
    loss: Literal["ce", "kl", "lk"] = "ce"
    """Per-slot loss: cross-entropy to a hard label, KL to the target distribution (fp32), or
    lk: minus the expected accepted length built from per-slot acceptance 1 - TV(draft, target)."""
    lk_weight: float = setting(0.0, lo=0, hi=1e6, why="0 = off")
    """Weight of the acceptance-direct (lk) term added to a ce or kl loss."""
    selector_loss_weight: float = setting(1.0, lo=0, hi=1e6, why="0 leaves the selector untrained")
    """DFlash2: weight of the selector's K-way cross-entropy beside the block loss."""
    selector_lr_scale: float = setting(1.0, lo=0, lo_open=True, hi=1e4)
    """DFlash2: the selector's lr as a multiple of lr (it starts as a no-op and learns slowly
    at a backbone's lr; the convolutions keep lr)."""
    labels: Literal["target", "data"] = "target"
    """What a slot learns: the target's own prediction, or the dataset token."""
    weighting: Literal["decay", "dpace"] = "decay"
    """Per-slot weights: exp(-(k-1)/gamma) or D-PACE confidence-weighted suffix sums."""
    gamma: float | None = setting(None, lo=0, lo_open=True, hi=1e6)
    """Decay constant (default by block size: 16->7, 10->5, 8->4, else B/2)."""
    dpace_alpha: float = setting(0.5, lo=0, hi=1)
    """Confidence smoothing of dpace."""
    loss_chunk_rows: int = setting(2048, lo=1, hi=2**20)
    """Rows (anchor slots) per lm_head chunk: bounds the [rows, vocab] logits in memory."""
    compile: bool | None = None
    """torch.compile FlexAttention lazily on the first step (default: on with CUDA, off on CPU)."""
    precision: Literal["bf16", "fp32"] = "bf16"
    """Compute precision of the drafter (bf16 autocast with fp32 master weights)."""
    seed: int = setting(0, **_SEED)
    """Seed for init, anchors and noise."""
    log_every: int = setting(50, **_COUNT)
    """Steps between metric logs."""
    checkpoint_every: int = setting(5000, **_COUNT)
    """Steps between checkpoints (plus one at the end)."""
    keep_last: int = setting(3, lo=1, hi=2**16)
    """Checkpoints kept."""
    eval_every: int = setting(0, lo=0, hi=BIG, why="0 = off")
    """Steps between in-training speculative evals (0 = off)."""
    max_bad_steps: int = setting(5, lo=1, hi=2**20)
    """Consecutive NaN/inf steps that stop the run."""
    device: str = "auto"
    """cuda, cpu, or auto."""
    pack_documents: bool = True
    """Pack many documents into one drafter forward (False: one document per forward, for benchmarks)."""
    step_path: Literal["auto", "fast", "standard"] = "auto"
    """fast: fixed shapes, target in CUDA graphs, no host waits inside a step (train/fast_step.py);
    standard: shapes follow the data; auto: fast for small full-attention targets on one GPU."""
    target_chunk_tokens: int = setting(16384, lo=256, hi=MAX_TOKENS, why=_TOKENS_WHY)
    """Fast step: rows x length of one target forward (one CUDA graph per row-length bucket)."""
    target_attention: Literal["dense", "flex"] = "dense"
    """Fast step: the target's attention over rows that several documents share: dense (a
    block-diagonal mask, L x L pairs a row) or flex (FlexAttention over only the key blocks
    each document reaches, compiled; on CPU an unfused reference path, for tests;
    train/fast_target.py)."""

    def __post_init__(self) -> None:
        check_section(self, "training")
        p = "training"
        if self.weighting == "dpace" and self.loss != "ce":
            fail(
                f"{p}.weighting",
                "dpace weights are defined from cross-entropy confidences; set training.loss=ce "
                "or training.weighting=decay",
            )
        if self.loss in ("kl", "lk") and self.labels == "data":
            fail(
                f"{p}.loss",
                f"{self.loss} needs the target's distribution; with training.labels=data use "
                "loss=ce",
            )
        if self.lk_weight > 0 and self.labels == "data":
            fail(
                f"{p}.lk_weight",
                "the lk term needs the target's distribution; with training.labels=data set "
                "lk_weight=0",
            )
        if self.lk_weight > 0 and self.loss == "lk":
            fail(f"{p}.lk_weight", "loss=lk is the lk term alone; set lk_weight=0 or loss=ce/kl")
        d = self.device
        if d not in ("auto", "cpu", "cuda") and not (d.startswith("cuda:") and d[5:].isdigit()):
            fail(f"{p}.device", f"use auto, cpu, cuda or cuda:N, got {d!r}")

    @property
    def target_distribution(self) -> bool:
        """Whether the loss reads the target's whole next-token distribution (kl, lk), not
        only its argmax: the step then carries the target's final hidden states."""
        return self.loss in ("kl", "lk") or self.lk_weight > 0

    def resolved_gamma(self, block_size: int) -> float:
        if self.gamma is not None:
            return self.gamma
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2)


@dataclass(frozen=True)
class RunConfig:
    """Where the run lives."""

    output_dir: str = setting(
        "runs/dflash",
        min_len=1,
        local=True,
        why="put checkpoints in an object store with run.checkpoint_dir",
    )
    """Run directory (config, metrics, checkpoints, plots, final drafter): a local path."""
    checkpoint_dir: str | None = setting(None, min_len=1, path=True)
    """Checkpoint location if not <output_dir>/checkpoints (e.g. s3://bucket/run)."""
    name: str | None = None
    """Human name of the run (defaults to the output dir name)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for a remote checkpoint_dir (e.g. endpoint_url, key, secret for s3://)."""

    def __post_init__(self) -> None:
        check_section(self, "run")


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
    tensor_parallel_size: int = setting(1, lo=1, hi=1024)
    """Serving TP size to check head divisibility against (doctor only)."""

    def __post_init__(self) -> None:
        check_section(self, "distributed")
        if self.target_sharding == "fsdp" and self.placement == "pairs":
            # pairs runs the target in a background thread while the main thread runs
            # the drafter's collectives: the two streams of collectives could interleave
            # differently on different ranks and hang.
            fail(
                "distributed.target_sharding",
                "fsdp needs placement=colocated (pairs runs the target in a thread beside "
                "the drafter's collectives); use target_sharding=device_map with pairs",
            )


@dataclass(frozen=True)
class EvalConfig:
    """Speculative-decoding evaluation settings."""

    prompts: tuple[str, ...] = setting(
        ("gsm8k",), min_len=1, max_len=64, item=Rule(min_len=1, path=True)
    )
    """Prompt sets: gsm8k, mt-bench, humaneval, or paths to JSONL prompt files."""
    max_samples: int | None = setting(32, lo=1, hi=BIG)
    """Prompts per set."""
    max_new_tokens: int = setting(256, lo=1, hi=MAX_TOKENS)
    """Tokens generated per response."""
    temperature: float = setting(0.0, lo=0, hi=100, why="0 = greedy")
    """0 = greedy (lossless check), > 0 = exact sampling."""
    top_p: float = setting(1.0, lo=0, lo_open=True, hi=1)
    """Nucleus sampling of the target when temperature > 0."""
    draft_temperature_scale: float = setting(1.0, lo=0, lo_open=True, hi=10)
    """At temperature T > 0 the drafts are sampled at this multiple of T. Lossless at any
    value (each draft is verified against the exact distribution it was drawn from); only
    acceptance changes (measured: benchmarks/draft_temperature_t1_smollm2_cpu_202612.md)."""
    seed: int = setting(0, **_SEED)
    """Sampling seed."""
    enable_thinking: bool = False
    """Pass enable_thinking to chat templates that support it."""
    train_eval_samples: int = setting(8, lo=0, hi=2**20)
    """Prompts used by the in-training eval."""
    train_walk_docs: int = setting(16, lo=0, hi=2**20, why="0 turns the held-out walk off")
    """Held-out documents walked by the in-training eval (walk_eval.py); 0 turns it off."""

    def __post_init__(self) -> None:
        check_section(self, "eval")


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

    def __post_init__(self) -> None:
        check_section(self, "")
        if self.target.precision == "fp8":
            if self.training.device == "cpu":
                fail(
                    "target.precision",
                    "fp8 needs a CUDA GPU of compute capability >= 8.9, but training.device is "
                    "cpu; use target.precision=bf16 on the CPU",
                )
            if self.distributed.target_sharding == "fsdp":
                fail(
                    "target.precision",
                    "fp8 keeps its quantized weights in buffers, which FSDP does not shard; use "
                    "distributed.target_sharding=replicate (an FP8 target takes half the memory) "
                    "or device_map",
                )
