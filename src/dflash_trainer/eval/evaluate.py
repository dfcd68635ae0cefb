"""`dflash eval`: acceptance length, speedup and the lossless check over prompt sets.

What is measured, per prompt set (docs/evaluation.md explains each number):
- tau (z-lab convention): mean over responses of the per-response mean of (accepted + 1);
  tau_pooled: (accepted + 1) averaged over all steps of all responses (long responses weigh
  more). Each MT-Bench turn is one response.
- histogram of accepted drafts per step (0..B-1) and per-position acceptance
  P(slot k accepted | slot k reached).
- decode speedup: target-only TPOT / speculative TPOT, both from `speculative.generate` in
  this run on the same prompt ids, prefill excluded; decode tokens/s of both.
- lossless check (temperature 0): speculative tokens == target greedy tokens, with the first
  differing index and the target's top-2 logit gap there (a gap near 0 is a numerical tie
  between a B-token and a 1-token forward, not a loop bug).

`evaluate_prompts` is what the trainer calls every eval_every steps; `run` is the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_trainer.config import EvalConfig, TargetConfig
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.prompts import Messages
from dflash_trainer.eval.report import (
    build_report,
    lossless_check,
    markdown,
    summarize,
    write_all,
    write_json,
)
from dflash_trainer.eval.speculative import (
    BlockDrafter,
    DFlashBlockDrafter,
    Generation,
    generate,
    unwrap_module,
)
from dflash_trainer.eval.static_decode import DECODE_MODES, DecodeEngines
from dflash_trainer.target.model import FrozenTarget

# ----------------------------------------------------------------------------- the eval loop


def render_prompt(tokenizer: Any, messages: Messages, enable_thinking: bool) -> list[int]:
    """Chat template with the generation prompt, tokenized without extra special tokens."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """EOS of the tokenizer and of the model's generation config (an int or a list)."""
    ids: set[int] = set()
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return sorted(ids)


def check_compatible(spec: DrafterSpec, target: FrozenTarget) -> None:
    """The target must be the one the drafter was trained on (shapes and tapped layers)."""
    cfg = target.model.config.get_text_config()
    have = {
        "hidden_size": int(cfg.hidden_size),
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "vocab_size": int(target.lm_head_weight.shape[0]),
        "tapped layers": list(target.layer_ids),
    }
    want = {
        "hidden_size": spec.target_hidden_size,
        "num_hidden_layers": spec.num_target_hidden_layers,
        "vocab_size": spec.vocab_size,
        "tapped layers": list(spec.target_layer_ids),
    }
    bad = [f"{k}: target {have[k]}, drafter {want[k]}" for k in have if have[k] != want[k]]
    if bad:
        raise DFlashError(
            "the drafter does not fit this target (" + "; ".join(bad) + "); evaluate it with "
            "the target it was trained for (--target), built with the drafter's target_layer_ids"
        )


@contextlib.contextmanager
def _eval_mode(module: nn.Module | None) -> Iterator[None]:
    """Eval mode (no feature noise) for the duration; the trainer's mode is restored after."""
    if module is None:
        yield
        return
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _block_drafter(
    drafter: nn.Module | BlockDrafter, target: FrozenTarget, block_size: int | None
) -> tuple[BlockDrafter, nn.Module | None]:
    if isinstance(drafter, nn.Module):
        inner = unwrap_module(drafter)
        spec = inner.spec
        assert isinstance(spec, DrafterSpec)
        check_compatible(spec, target)
        return DFlashBlockDrafter(inner, target, block_size), inner
    return drafter, None


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def evaluate_prompts(
    drafter: nn.Module | BlockDrafter,
    target: FrozenTarget,
    tokenizer: Any,
    prompts: Sequence[Messages],
    eval_cfg: EvalConfig,
    baseline: bool = False,
    *,
    block_size: int | None = None,
    stop_ids: Sequence[int] | None = None,
    prompt_ids: Sequence[str] | None = None,
    warmup: bool = False,
    progress: str | None = None,
    decode: str = "eager",
) -> dict[str, Any]:
    """Run the real speculative loop over conversations; measured tau and friends.

    `drafter` is a DFlashDrafter (possibly DDP/compile-wrapped; put in eval mode for the call)
    or any BlockDrafter. With `baseline`, every turn is also decoded target-only on the same
    prompt ids: speedup, and at temperature 0 the lossless check. Turns answered in order;
    each speculative answer is fed back as the assistant turn before the next user turn.
    Returns flat metrics (tau, tau_pooled, per_position_acceptance, accepted_histogram,
    decode_tokens_per_s, and with baseline: speedup, lossless_mismatches) plus "responses".
    `warmup` first decodes the first prompt briefly with both loops, untimed, so one-off
    costs (CUDA context, kernel selection, allocator growth) land in neither measurement.
    `progress` names a progress bar over the conversations (stderr), with the running tau.
    `decode` (static_decode.DECODE_MODES) picks how both loops run the models: "graphs"
    replays CUDA graphs of fixed-size caches, "eager" runs HF's dynamic cache; the result's
    "decode" says which ran.
    """
    from tqdm import tqdm

    block, module = _block_drafter(drafter, target, block_size)
    engines = DecodeEngines(target, decode, module, block.block_size, block.needs_features)
    stops = list(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, target.model)
    run = _PromptRun(target, tokenizer, eval_cfg, engines, block, baseline, stops)
    with _eval_mode(module):
        if warmup and prompts:
            run.warm_up(prompts[0])
        bar = tqdm(
            prompts, desc=progress, disable=progress is None, unit="prompt", dynamic_ncols=True
        )
        for i, conversation in enumerate(bar):
            run.conversation(conversation, prompt_ids[i] if prompt_ids is not None else str(i))
            steps = [a for g in run.spec_gens for a in g.accepted]
            if steps:
                bar.set_postfix(pooled_tau=f"{sum(a + 1 for a in steps) / len(steps):.2f}")
    return {
        "decode": engines.mode,
        **summarize(run.responses, run.spec_gens, run.base_gens, block.block_size, run.greedy),
    }


class _PromptRun:
    """One evaluation's loops and results: each user turn decoded speculatively (and
    target-only with `baseline`), answers fed back as the assistant turn."""

    def __init__(
        self,
        target: FrozenTarget,
        tokenizer: Any,
        eval_cfg: EvalConfig,
        engines: DecodeEngines,
        block: BlockDrafter,
        baseline: bool,
        stops: list[int],
    ) -> None:
        self.target, self.tokenizer, self.eval_cfg = target, tokenizer, eval_cfg
        self.engines, self.block, self.baseline = engines, block, baseline
        self.greedy = eval_cfg.temperature == 0
        self.kw: dict[str, Any] = {
            "max_new_tokens": eval_cfg.max_new_tokens,
            "temperature": eval_cfg.temperature,
            "top_p": eval_cfg.top_p,
            "stop_ids": stops,
        }
        self.spec_gens: list[Generation] = []
        self.base_gens: list[Generation] = []
        self.responses: list[dict[str, Any]] = []

    def loops(self, ids: list[int], speculative: bool) -> dict[str, Any]:
        """generate()'s drafter and runner for this prompt (both loops share the runner)."""
        self.engines.ensure(len(ids) + self.eval_cfg.max_new_tokens + 2 * self.block.block_size)
        d = (self.engines.drafter or self.block) if speculative else None
        return {"drafter": d, "runner": self.engines.runner}

    def warm_up(self, first: Messages) -> None:
        """Decode the first prompt briefly with both loops, untimed (one-off costs)."""
        upto = next((j for j, m in enumerate(first) if m["role"] == "user"), len(first))
        ids = render_prompt(self.tokenizer, first[: upto + 1], self.eval_cfg.enable_thinking)
        short = {**self.kw, "max_new_tokens": min(16, self.eval_cfg.max_new_tokens)}
        for spec in (True, False) if self.baseline else (True,):
            gen = _generator(self.target.device, 0)
            generate(self.target, ids, generator=gen, **short, **self.loops(ids, spec))

    def conversation(self, conversation: Messages, prompt_id: str) -> None:
        history: Messages = []
        for j, msg in enumerate(conversation):
            history.append(dict(msg))
            answered = j + 1 < len(conversation) and conversation[j + 1]["role"] == "assistant"
            if msg["role"] != "user" or answered:
                continue
            rec = self.answer(history, prompt_id)
            history.append({"role": "assistant", "content": rec["text"]})

    def answer(self, history: Messages, prompt_id: str) -> dict[str, Any]:
        """Decode one turn (and its baseline); its record is appended to `responses`."""
        ids = render_prompt(self.tokenizer, history, self.eval_cfg.enable_thinking)
        # One seed per response: the same turn samples alike in both runs.
        seed = self.eval_cfg.seed + len(self.responses)
        gen = _generator(self.target.device, seed)
        g = generate(self.target, ids, generator=gen, **self.kw, **self.loops(ids, True))
        self.spec_gens.append(g)
        rec = _record(g, prompt_id, history)
        if self.baseline:
            gen = _generator(self.target.device, seed)
            b = generate(
                self.target,
                ids,
                generator=gen,
                record_margins=self.greedy,
                **self.kw,
                **self.loops(ids, False),
            )
            self.base_gens.append(b)
            rec["baseline"] = {
                "new_tokens": len(b.tokens),
                "prefill_s": b.prefill_s,
                "decode_s": b.decode_s,
            }
            if self.greedy:
                rec["lossless"] = lossless_check(g, b)
        rec["text"] = self.tokenizer.decode(g.tokens, skip_special_tokens=True)
        self.responses.append(rec)
        return rec


def _record(g: Generation, prompt_id: str, history: Messages) -> dict[str, Any]:
    return {
        "prompt": prompt_id,
        "turn": sum(m["role"] == "user" for m in history) - 1,
        "prompt_tokens": g.prompt_len,
        "new_tokens": len(g.tokens),
        "tau": sum(a + 1 for a in g.accepted) / len(g.accepted) if g.accepted else None,
        "accepted": g.accepted,
        "stop_reason": g.stop_reason,
        "prefill_s": g.prefill_s,
        "decode_s": g.decode_s,
    }


# ----------------------------------------------------------------------------- loading


@dataclass
class EvalModels:
    drafter: nn.Module
    target: FrozenTarget
    tokenizer: Any
    identity: dict[str, Any]
    """What was evaluated: drafter path/format/spec/fingerprint, target source/dtype/shape."""


def split_target(name: str) -> tuple[str, str | None]:
    """`DIR::FILE.gguf` or `path/FILE.gguf` -> (dir, file); anything else -> (name, None)."""
    if "::" in name:
        directory, gguf = name.split("::", 1)
        return directory, gguf
    if name.endswith(".gguf"):
        path = Path(name)
        return str(path.parent), path.name
    return name, None


def read_drafter(path: str) -> tuple[DrafterSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """This project's files (run / checkpoint / drafter dir) or, through `export.import_drafter`
    when that module is installed, a z-lab or speculators export."""
    from dflash_trainer.formats.drafter_io import load_drafter

    try:
        export = importlib.import_module("dflash_trainer.formats.export")
    except ImportError:
        return load_drafter(path)
    result: tuple[DrafterSpec, dict[str, torch.Tensor], dict[str, Any]] = export.import_drafter(
        path
    )
    return result


def _fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the weights (sorted names, raw bytes): which drafter, beyond its path."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _target_config(
    meta: dict[str, Any], target: str | None, dtype: str | None, device: str
) -> TargetConfig:
    recorded = meta.get("target") or {}
    if target is None:
        if not recorded.get("name_or_path"):
            raise DFlashError(
                "the drafter records no target; pass --target NAME_OR_PATH (hub id, local dir, "
                "asset:<name> or DIR::FILE.gguf)"
            )
        name, gguf = recorded["name_or_path"], recorded.get("gguf_file")
    else:
        name, gguf = split_target(target)
    if dtype is None:
        # bf16 matmuls on CPU are slow and not what a server runs: fp32 there.
        dtype = "float32" if device == "cpu" else recorded.get("dtype") or "bfloat16"
    return TargetConfig(name_or_path=name, gguf_file=gguf, dtype=dtype)  # type: ignore[arg-type]


def load_eval_models(
    drafter_path: str,
    target: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
) -> EvalModels:
    """Drafter (eval mode, fp32 weights cast to the target dtype), FrozenTarget, tokenizer."""
    from dflash_trainer.core.drafter import DFlashDrafter
    from dflash_trainer.data import load_tokenizer
    from dflash_trainer.target.model import load_target_model

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec, state, meta = read_drafter(drafter_path)
    tcfg = _target_config(meta, target, dtype, torch.device(dev).type)
    model = load_target_model(tcfg, dev)
    frozen = FrozenTarget(model, spec.target_layer_ids)
    check_compatible(spec, frozen)
    drafter = DFlashDrafter(spec)
    try:
        drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise DFlashError(f"{drafter_path}: weights do not match the drafter spec ({e})") from e
    drafter = drafter.to(device=dev, dtype=model.dtype).eval()
    tok_spec = f"{tcfg.name_or_path}::{tcfg.gguf_file}" if tcfg.gguf_file else tcfg.name_or_path
    tokenizer = load_tokenizer(tok_spec)
    cfg = model.config.get_text_config()
    identity = {
        "drafter": {
            "path": str(drafter_path),
            "format": (meta.get("source") or {}).get("format", "dflash"),
            "fingerprint": _fingerprint(state),
            "spec": spec.to_dict(),
            "meta": {k: v for k, v in meta.items() if k != "source"},
        },
        "target": {
            "name_or_path": tcfg.name_or_path,
            "gguf_file": tcfg.gguf_file,
            "dtype": tcfg.dtype,
            "class": type(model).__name__,
            "num_hidden_layers": int(cfg.num_hidden_layers),
            "hidden_size": int(cfg.hidden_size),
            "vocab_size": int(cfg.vocab_size),
        },
        "environment": _environment(dev),
    }
    return EvalModels(drafter, frozen, tokenizer, identity)


def _environment(device: str) -> dict[str, Any]:
    import transformers

    env = {
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


# ----------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = EvalConfig()
    p.add_argument(
        "--drafter", required=True, help="run dir, checkpoint dir, or a z-lab/speculators export"
    )
    p.add_argument(
        "--target",
        help="target model (default: the one recorded with the drafter); DIR::FILE.gguf for a GGUF",
    )
    p.add_argument(
        "--target-dtype",
        choices=["bfloat16", "float16", "float32"],
        help="default: float32 on CPU, else the recorded dtype",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument(
        "--prompts",
        default=",".join(d.prompts),
        help="comma list of gsm8k, mt-bench, humaneval or JSONL files",
    )
    p.add_argument(
        "--max-samples", type=int, default=d.max_samples, help="prompts per set (0 = all)"
    )
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument(
        "--temperature", type=float, default=d.temperature, help="0 = greedy + lossless check"
    )
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed, help="prompt subset and sampling seed")
    p.add_argument(
        "--enable-thinking",
        action="store_true",
        help="pass enable_thinking=True to the chat template",
    )
    p.add_argument(
        "--block-size", type=int, help="draft fewer slots than the drafter was trained with"
    )
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the target-only runs (no speedup, no lossless check)",
    )
    p.add_argument(
        "--decode",
        choices=DECODE_MODES,
        default="auto",
        help="graphs: fixed-size caches replayed as CUDA graphs (both loops); eager: HF's "
        "dynamic cache; static: graphs' shapes without graphs; auto: graphs on CUDA when the "
        "target allows (attention-only, no sliding window), else eager",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bars (logs of detached jobs)"
    )
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument("--out-dir", help="write eval.json, eval.md and PNG plots here")
    p.add_argument("--allow-mismatch", action="store_true", help="exit 0 even when the lossless check fails")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from dflash_trainer.eval.prompts import load_prompt_set, set_label

    cfg = EvalConfig(
        prompts=tuple(s for s in args.prompts.split(",") if s),
        max_samples=args.max_samples or None,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        enable_thinking=args.enable_thinking,
    )
    sets = [load_prompt_set(name, cfg.max_samples, cfg.seed) for name in cfg.prompts]
    models = load_eval_models(args.drafter, args.target, args.target_dtype, args.device)
    results: dict[str, Any] = {}
    partial = Path(args.json) if args.json else None
    if partial is None and args.out_dir:
        partial = Path(args.out_dir) / "eval.json"
    for ps in sets:
        label = set_label(ps.name)
        print(f"dflash eval: {label}: {len(ps.prompts)} of {ps.total} prompts", file=sys.stderr)
        t0 = time.perf_counter()
        res = evaluate_prompts(
            models.drafter,
            models.target,
            models.tokenizer,
            [p.messages for p in ps.prompts],
            cfg,
            baseline=not args.no_baseline,
            block_size=args.block_size,
            prompt_ids=[p.id for p in ps.prompts],
            warmup=not results,  # the first set pays the one-off costs, untimed
            progress=None if args.no_progress else label,
            decode=args.decode,
        )
        res["num_prompts"], res["source"], res["total_prompts"] = len(ps.prompts), ps.name, ps.total
        results[label] = res
        print(
            f"dflash eval: {label}: tau {_num(res.get('tau'))}, speedup "
            f"{_num(res.get('speedup'))}x, decode {res['decode']} "
            f"({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
        )
        if partial is not None:
            # Each finished set is on disk at once: a long eval cut short keeps what it measured.
            write_json(build_report(results, cfg, models.identity, vars(args)), partial)
    report = build_report(results, cfg, models.identity, vars(args))
    print(markdown(report))
    if args.json:
        write_json(report, Path(args.json))
    if args.out_dir:
        written = write_all(report, Path(args.out_dir))
        print(f"dflash eval: wrote {', '.join(str(w) for w in written)}", file=sys.stderr)
    mismatches = sum(r.get("lossless_mismatches", 0) for r in results.values())
    if mismatches:
        print(
            f"dflash eval: LOSSLESS CHECK FAILED: {mismatches} response(s) differ from the "
            "target's greedy output (see 'mismatched' in the report; a target_margin near 0 "
            "is a numerical tie, anything else is a bug)",
            file=sys.stderr,
        )
        return 0 if args.allow_mismatch else 1
    return 0


def _num(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "-"
