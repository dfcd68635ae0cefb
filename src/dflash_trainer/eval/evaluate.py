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
The per-turn decoding is prompt_run.py; loading the drafter and target is loading.py.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from dflash_trainer import cli_numbers as num
from dflash_trainer.config import EvalConfig
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.eval.loading import check_compatible, load_eval_models
from dflash_trainer.eval.prompt_run import PromptRun, stop_token_ids
from dflash_trainer.eval.prompts import Messages
from dflash_trainer.eval.report import build_report, markdown, summarize, write_all, write_json
from dflash_trainer.eval.speculative import (
    DRAFT_SAMPLING,
    BlockDrafter,
    DFlashBlockDrafter,
    unwrap_module,
)
from dflash_trainer.eval.static_decode import DECODE_MODES, DecodeEngines, compile_drafter_error
from dflash_trainer.eval.walk import candidate_walk
from dflash_trainer.target.model import FrozenTarget

# ----------------------------------------------------------------------------- the eval loop


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
    drafter: nn.Module | BlockDrafter,
    target: FrozenTarget,
    block_size: int | None,
    draft_sampling: str,
    draft_temperature_scale: float = 1.0,
) -> tuple[BlockDrafter, nn.Module | None]:
    if isinstance(drafter, nn.Module):
        inner = unwrap_module(drafter)
        spec = inner.spec
        assert isinstance(spec, DrafterSpec)
        check_compatible(spec, target)
        block = DFlashBlockDrafter(
            inner, target, block_size, draft_sampling, draft_temperature_scale
        )
        return block, inner
    return drafter, None


def _answer_all(
    run: PromptRun,
    prompts: Sequence[Messages],
    prompt_ids: Sequence[str] | None,
    progress: str | None,
) -> None:
    """Every conversation through `run`, in order, under a progress bar with the pooled tau."""
    from tqdm import tqdm

    bar = tqdm(prompts, desc=progress, disable=progress is None, unit="prompt", dynamic_ncols=True)
    for i, conversation in enumerate(bar):
        run.conversation(conversation, prompt_ids[i] if prompt_ids is not None else str(i))
        steps = [a for g in run.spec_gens for a in g.accepted]
        if steps:
            bar.set_postfix(pooled_tau=f"{sum(a + 1 for a in steps) / len(steps):.2f}")


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
    draft_sampling: str = "auto",
    candidates: int = 0,
    candidate_responses: int = 10,
    compile_drafter: bool = False,
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
    "decode" says which ran. `draft_sampling` (speculative.DRAFT_SAMPLING) says whether drafts
    are sampled at temperature > 0 (verified by rejection sampling) or greedy. `candidates`
    K > 0 (temperature 0 only): walk the first `candidate_responses` answers again, which are
    the target's greedy output, for the walked tau, the oracle top-K tau and per-slot recall
    (walk.candidate_walk), under "candidates". `compile_drafter` compiles the drafter step of
    the static modes (a DFlashError with "eager"); "compiled_drafter" says whether it ran so.
    """
    scale = eval_cfg.draft_temperature_scale
    block, module = _block_drafter(drafter, target, block_size, draft_sampling, scale)
    engines = DecodeEngines(
        target,
        decode,
        module,
        block.block_size,
        block.needs_features,
        draft_sampling,
        eval_cfg.temperature,
        compile_drafter,
        scale,
    )
    stops = list(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, target.model)
    run = PromptRun(target, tokenizer, eval_cfg, engines, block, baseline, stops)
    with _eval_mode(module):
        if warmup and prompts:
            run.warm_up(prompts[0])
        _answer_all(run, prompts, prompt_ids, progress)
    out = {
        "decode": engines.mode,
        "compiled_drafter": engines.compile_drafter,
        "draft_temperature_scale": scale,
        **summarize(run.responses, run.spec_gens, run.base_gens, block.block_size, run.greedy),
    }
    if candidates and run.greedy and module is not None:
        with _eval_mode(module):
            answers = run.answers[:candidate_responses]
            out["candidates"] = candidate_walk(module, target, answers, candidates)
    return out


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
    p.add_argument(
        "--target-precision",
        choices=["bf16", "fp8"],
        default="bf16",
        help="fp8: the target's linears in FP8 (a GPU of compute capability >= 8.9; "
        "docs/fp8-target.md); default bf16",
    )
    p.add_argument(
        "--device", type=num.device(), help="cpu, cuda, cuda:1 (default: cuda when available)"
    )
    p.add_argument(
        "--prompts",
        default=",".join(d.prompts),
        help="comma list of gsm8k, mt-bench, humaneval or JSONL files",
    )
    p.add_argument(
        "--max-samples", type=num.count(0), default=d.max_samples, help="prompts per set (0 = all)"
    )
    p.add_argument("--max-new-tokens", type=num.count(1, 1 << 20), default=d.max_new_tokens)
    p.add_argument(
        "--temperature",
        type=num.temperature(),
        default=d.temperature,
        help="0 = greedy + lossless check",
    )
    p.add_argument("--top-p", type=num.fraction(open_low=True), default=d.top_p)
    p.add_argument(
        "--draft-temperature-scale",
        type=num.positive(hi=10),
        default=d.draft_temperature_scale,
        help="at temperature T > 0, sample the drafts at this multiple of T (lossless at any "
        "value; below 1 sharpens the drafts)",
    )
    p.add_argument(
        "--seed", type=num.seed(), default=d.seed, help="prompt subset and sampling seed"
    )
    p.add_argument(
        "--enable-thinking",
        action="store_true",
        help="pass enable_thinking=True to the chat template",
    )
    p.add_argument(
        "--block-size",
        type=num.count(1, 4096),
        help="draft fewer slots than the drafter was trained with",
    )
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the target-only runs (no speedup, no lossless check)",
    )
    _add_decoding_arguments(p)
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bars (logs of detached jobs)"
    )
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument("--out-dir", help="write eval.json, eval.md and PNG plots here")
    p.add_argument("--allow-mismatch", action="store_true", help="exit 0 even when the lossless check fails")  # fmt: skip


def _add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    """How the loop decodes and drafts, and the t=0 candidate walk."""
    p.add_argument(
        "--decode",
        choices=DECODE_MODES,
        default="auto",
        help="graphs: fixed-size caches replayed as CUDA graphs (both loops); eager: HF's "
        "dynamic cache; static: graphs' shapes without graphs; auto: graphs on CUDA when the "
        "target allows (attention-only, no sliding window), else eager",
    )
    p.add_argument(
        "--compile-drafter",
        action="store_true",
        help="with --decode static or graphs: torch.compile the drafter step into few fused "
        "kernels, before the timed decode (pays on a GPU with a small target, where a DFlash2 "
        "step is hundreds of tiny kernels)",
    )
    p.add_argument(
        "--draft-sampling",
        choices=DRAFT_SAMPLING,
        default="auto",
        help="at temperature > 0: sample drafts from the drafter (rejection sampling keeps the "
        "output exact) or draft greedily; auto samples (DFlash2 through its selector walk)",
    )
    p.add_argument(
        "--candidates",
        type=num.count(0, 1 << 16),
        default=0,
        metavar="K",
        help="at temperature 0, also walk the answers for the oracle top-K tau and per-slot "
        "recall@1/@K (0 = off)",
    )
    p.add_argument(
        "--candidate-responses",
        type=num.count(1, 1 << 20),
        default=10,
        help="answers walked for --candidates per prompt set",
    )


def run(args: argparse.Namespace) -> int:
    """Check the output paths and hold them (one eval writes a report at a time) throughout:
    an eval that would fail to write its report fails before it runs, not after."""
    from dflash_trainer.eval.report import check_report_path
    from dflash_trainer.outputs import output_dir, output_file, writing

    with contextlib.ExitStack() as held:
        if args.json:
            args.json = output_file(args.json, "--json")
            check_report_path(args.json, "--json")
            held.enter_context(writing(args.json, "dflash eval", f"the report {args.json}"))
        if args.out_dir:
            args.out_dir = output_dir(args.out_dir, "--out-dir")
            check_report_path(args.out_dir / "eval.json", "--out-dir")
            held.enter_context(
                writing(args.out_dir, "dflash eval", f"the reports in {args.out_dir}")
            )
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from dflash_trainer.eval.prompts import load_prompt_set, set_label

    if args.compile_drafter and args.decode == "eager":  # said before the models load
        raise compile_drafter_error(args.decode)
    cfg = EvalConfig(
        prompts=tuple(s for s in args.prompts.split(",") if s),
        max_samples=args.max_samples or None,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        draft_temperature_scale=args.draft_temperature_scale,
        seed=args.seed,
        enable_thinking=args.enable_thinking,
    )
    sets = [load_prompt_set(name, cfg.max_samples, cfg.seed) for name in cfg.prompts]
    models = load_eval_models(
        args.drafter, args.target, args.target_dtype, args.device, args.target_precision
    )
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
            draft_sampling=args.draft_sampling,
            candidates=args.candidates,
            candidate_responses=args.candidate_responses,
            compile_drafter=args.compile_drafter,
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
