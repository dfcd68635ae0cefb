"""`dflash data prepare | regenerate | prompts | synthesize | stats`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from dflash_trainer import cli_numbers as num
from dflash_trainer.cli_paths import text  # free text, kept as given (no ~ expansion)
from dflash_trainer.data import prompts_cli
from dflash_trainer.data.formats import FORMATS
from dflash_trainer.data.loop_tails import LOOP_TAILS
from dflash_trainer.data.openai_backend import add_server_arguments
from dflash_trainer.errors import DFlashError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_THINKING = {"on": True, "off": False, "default": None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(
        dest="data_command", metavar="{prepare,regenerate,prompts,synthesize,stats}"
    )

    _add_prepare(sub)
    _add_regenerate(sub)
    prompts_cli.add_parser(sub)
    _add_synthesize(sub)

    s = sub.add_parser("stats", help="statistics of a prepared directory or a prompts file")
    s.add_argument("path", type=Path)
    s.add_argument("--split", default="all", help="train, eval or all")
    s.add_argument("--budget", type=num.count(), default=8192)
    s.add_argument("--png", type=Path, help="write a length histogram PNG here")
    s.add_argument("--verify", action="store_true", help="check every shard's sha256")
    parser.set_defaults(_data_parser=parser)


def _add_prepare(sub: Any) -> None:
    p = sub.add_parser("prepare", help="conversations -> chat template + masks -> shards")
    p.add_argument("--input", required=True, help="file, folder, asset:<name> or hf:<dataset>")
    p.add_argument("--format", default="auto", choices=FORMATS)
    p.add_argument(
        "--tokenizer",
        default="asset:smollm2-135m-instruct",
        help="asset:<name>, a directory, a .gguf file, DIR::FILE.gguf or a hub id",
    )
    p.add_argument("--out", required=True, type=Path, help="the prepared directory to write")
    p.add_argument("--max-records", type=num.count(), help="read at most N source records")
    p.add_argument("--max-tokens", type=num.count(), help="skip documents longer than N tokens")
    p.add_argument("--eval-fraction", type=num.fraction(open_high=True), default=0.02)
    p.add_argument(
        "--loop-tails",
        choices=LOOP_TAILS,
        default="keep",
        help="mask: stop supervising the repeating tail of an answer that loops (a small "
        "target's greedy answers often cycle to the length limit; docs/data.md)",
    )
    p.add_argument(
        "--thinking",
        choices=sorted(_THINKING),
        default="default",
        help="enable_thinking for Qwen3-style templates",
    )
    p.add_argument(
        "--budget", type=num.count(), default=8192, help="token budget shown in the stats"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a different preparation")
    prompts_cli.add_exclude_lineage(p)


def _add_regenerate(sub: Any) -> None:
    r = sub.add_parser("regenerate", help="replace assistant turns by the target's own answers")
    r.add_argument("--input", required=True, help="file, folder, asset:<name> or hf:<dataset>")
    r.add_argument("--format", default="auto", choices=FORMATS)
    r.add_argument("--model", default="asset:smollm2-135m-instruct", help="the target")
    r.add_argument("--tokenizer", help="defaults to --model")
    r.add_argument("--out", required=True, type=Path, help="JSONL output (appended, resumable)")
    r.add_argument("--temperature", type=num.temperature(), default=0.0)
    r.add_argument("--top-p", type=num.fraction(open_low=True), default=1.0)
    r.add_argument("--max-new-tokens", type=num.count(1, 1 << 20), default=512)
    r.add_argument("--thinking", choices=sorted(_THINKING), default="default")
    r.add_argument(
        "--batch-size",
        type=num.count(1, 1 << 16),
        help="rows at once (default: 256 on the static engine, 32 on hf)",
    )
    r.add_argument("--max-records", type=num.count(), help="read at most N source records")
    r.add_argument(
        "--max-prompt-tokens",
        type=num.count(0),
        default=4096,
        help="a longer prompt ends its conversation (0: no limit)",
    )
    r.add_argument("--max-turns", type=num.count(), help="answer only the first N user turns")
    r.add_argument(
        "--time-limit",
        type=_positive_seconds,
        metavar="SECONDS",
        help="stop after SECONDS of generation, keeping every answered turn (a rerun resumes)",
    )
    r.add_argument(
        "--stop-loops",
        action="store_true",
        help="end an answer that repeats itself once it holds a loop tail (finish reason "
        "'loop'; docs/data.md, Loop tails): the loop's later copies are not generated",
    )
    r.add_argument(
        "--max-conversation-tokens",
        type=num.count(),
        help="end a conversation at the last turn whose render fits N tokens (default: no limit)",
    )
    r.add_argument(
        "--backend",
        choices=["auto", "hf", "static", "openai"],
        default="auto",
        help="auto: the static engine on a GPU when the target allows it, else hf; openai: an "
        "OpenAI-compatible server at --base-url serving --model (docs/serving.md)",
    )
    _add_engine_options(r)
    add_server_arguments(r)
    r.add_argument("--device", default="auto", type=num.device(auto=True), help="auto, cpu, cuda:1")
    r.add_argument("--dtype", default="auto", choices=_DTYPES, help="auto: bf16 on GPU")
    r.add_argument("--seed", type=num.seed(), default=0)
    r.add_argument("--no-progress", action="store_true")
    prompts_cli.add_exclude_lineage(r)


def run(args: argparse.Namespace) -> int:
    command = getattr(args, "data_command", None)
    if command is None:
        args._data_parser.print_help()
        return 2
    if command == "prepare":
        return _prepare(args)
    if command == "regenerate":
        return _regenerate(args)
    if command == "prompts":
        return prompts_cli.run(args)
    if command == "synthesize":
        return _synthesize(args)
    return _stats(args)


def _prepare(args: argparse.Namespace) -> int:
    from dflash_trainer.data.prepare import prepare_dataset
    from dflash_trainer.data.records import ReadReport
    from dflash_trainer.data.shards import read_manifest

    thinking = _THINKING[args.thinking]
    t0 = time.perf_counter()
    out = prepare_dataset(
        args.input,
        args.tokenizer,
        args.out,
        fmt=args.format,
        max_records=args.max_records,
        max_tokens=args.max_tokens,
        eval_fraction=args.eval_fraction,
        template_kwargs=None if thinking is None else {"enable_thinking": thinking},
        overwrite=args.overwrite,
        budget=args.budget,
        loop_tails=args.loop_tails,
        exclude=prompts_cli.lineage_turns(args.exclude_lineage),
    )
    manifest = read_manifest(out)
    print(ReadReport.from_dict(manifest["read_report"]).format())
    lin = manifest.get("lineage_exclusion")
    if lin:
        print(f"lineage: {lin['kept_for_later_turns']} conversations kept for their later turns, "
              f"{lin['context_turns']} recorded turns as context only")  # fmt: skip
    loops = manifest.get("loop_tails", {})
    if loops.get("mode") == "mask":
        print(
            f"loop tails: {loops['answers']} answers, {loops['unsupervised_tokens']} tokens "
            f"unsupervised, {loops['trimmed_tokens']} trailing tokens dropped"
        )
    print()
    print((out / "stats.txt").read_text(encoding="utf-8").rstrip())
    print(f"\nprepared {out} in {time.perf_counter() - t0:.1f} s", end="")
    print(f" (built in {manifest['prepare_seconds']} s)" if "prepare_seconds" in manifest else "")
    return 0


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _engine_or_hf(backend: str, model: object) -> str:
    """auto -> the static engine when it can run the target, else hf with a one-line notice."""
    from dflash_trainer.data.engine import engine_notice

    if backend != "auto":
        return backend
    why = engine_notice(model)
    if why is None:
        return "static"
    print(f"dflash: regenerating with the HF batched path: {why}", file=sys.stderr)
    return "hf"


def _regenerate(args: argparse.Namespace) -> int:
    from dflash_trainer.outputs import check_not_input, output_file, writing

    args.out = output_file(args.out, "--out")
    check_not_input(args.out, "--out", [args.model, args.tokenizer], data=[args.input])
    with writing(args.out, "dflash data regenerate", f"the regeneration output {args.out}"):
        return _regenerate_locked(args)


def _regenerate_locked(args: argparse.Namespace) -> int:
    from dflash_trainer.data.formats import read_records
    from dflash_trainer.data.loading import load_causal_lm, load_tokenizer
    from dflash_trainer.data.records import Conversation, ReadReport
    from dflash_trainer.data.regenerate import regenerate

    device = _resolve_device(args.device)
    backend = args.backend
    report = ReadReport(source=args.input)
    records = read_records(args.input, args.format, report, False, args.max_records)
    convs = [c for c in records if isinstance(c, Conversation)]
    print(report.format(), file=sys.stderr)
    if args.exclude_lineage:
        convs = prompts_cli.fresh_conversations(convs, args.exclude_lineage, args.max_turns)
    if not convs:
        raise DFlashError(f"no conversations with a user turn in {args.input}")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    model, server = None, None
    if backend == "openai":
        from dflash_trainer.data.openai_backend import server_from_args

        server = server_from_args(args)
    else:
        model = load_causal_lm(args.model, device, args.dtype)
        backend = _engine_or_hf(backend, model)
    result = regenerate(
        convs,
        model,
        tokenizer,
        args.out,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        enable_thinking=_THINKING[args.thinking],
        batch_size=args.batch_size or (256 if backend == "static" else 32),
        max_prompt_tokens=args.max_prompt_tokens or None,
        max_turns=args.max_turns,
        max_conversation_tokens=args.max_conversation_tokens,
        model_name=args.model,
        backend=backend,
        seed=args.seed,
        progress=not args.no_progress,
        engine=_engine_options(args),
        time_limit=args.time_limit,
        stop_loops=args.stop_loops,
        server=server,
    )
    print(
        f"wrote {result.written} records to {args.out} ({result.already_done} already done, "
        f"{result.continued} continued from the turns an earlier job answered, "
        f"{result.cut_at_interrupt} open conversations kept at the time limit, "
        f"{result.skipped_prompt_too_long} skipped: first prompt too long, "
        f"{result.truncated_at_prompt_limit} cut at the prompt limit, "
        f"{result.cut_at_conversation_limit} cut and {result.skipped_conversation_too_long} "
        "skipped at the conversation token limit, "
        f"{result.oom_splits} batches split after running out of GPU memory, "
        f"{result.not_answered} not answered by the server); "
        f"{result.new_tokens} new tokens in {result.seconds:.1f} s = "
        f"{result.tokens_per_second:.1f} tokens/s; finish reasons {result.finish_reasons}"
    )
    _log_run(args, result)
    return 0


def engine_line(stats: dict[str, Any]) -> str:
    """One line of the static engine's statistics: where a regeneration's time went."""
    steps = stats["decode_steps"]
    busy = stats["row_steps_busy"] / stats["row_steps"] if stats["row_steps"] else 0.0
    ms = 1000 * stats["decode_s"] / steps if steps else 0.0
    return (
        f"engine: {steps:,} decode steps ({stats['decode_s']:.1f} s waiting for their tokens, "
        f"{ms:.2f} ms a step, rows busy {busy:.0%}), {stats['prefills']:,} prefills ({stats['prefill_s']:.1f} s), host "
        f"{stats['host_s']:.1f} s, {stats['builds']} shape builds ({stats['build_s']:.1f} s); "
        f"{stats['continued']:,} turns continued in their rows ({stats['reused_tokens']:,} "
        f"history tokens not prefilled again); {stats.get('carried_rows', 0):,} rows carried "
        "into a longer cache instead of draining"
    )


def _log_run(args: argparse.Namespace, result: Any) -> None:
    """Print the engine's line and append this run to `<out>.runs.jsonl`: a job resumed over
    several runs keeps every run's counts, speed and engine time (one JSON line each)."""
    import json
    from dataclasses import asdict

    if result.engine:
        print(engine_line(result.engine))
    if result.server:
        from dflash_trainer.data.openai_backend import server_line

        print(server_line(result.server))
    record = asdict(result) | {
        "tokens_per_second": result.tokens_per_second,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {k: v for k, v in vars(args).items() if not k.startswith("_")},
    }
    path = Path(args.out).with_name(Path(args.out).name + ".runs.jsonl")
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The static engine's settings named on the command line (the engine's own defaults
    otherwise)."""
    return {
        "compile_decode": args.compile_decode,
        "compile_prefill": args.compile_prefill,
        "reuse_prefix": not args.no_reuse_prefix,
        "carry_rows": not args.no_carry_rows,
        "decode_attention": args.decode_attention,
        "decode_sdpa": args.decode_sdpa,
        "prefill_sdpa": args.prefill_sdpa,
    }


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """The static engine's flags, the same on `regenerate` and `synthesize`
    (`_engine_options` reads them back)."""
    p.add_argument(
        "--compile-decode",
        action="store_true",
        help="static engine: compile the decode step (fewer kernels; one compile for all shapes)",
    )
    p.add_argument(
        "--no-reuse-prefix",
        action="store_true",
        help="static engine: prefill a conversation's whole history at every turn (default: a "
        "turn continues in the row that holds the conversation)",
    )
    p.add_argument(
        "--no-carry-rows",
        action="store_true",
        help="static engine: let each cache length drain before the next starts (default: its "
        "last busy rows move into the next length's cache where it has rows to spare)",
    )
    p.add_argument(
        "--compile-prefill",
        action="store_true",
        help="static engine: compile the prefill forwards (symbolic shapes, two compiles)",
    )
    p.add_argument(
        "--decode-attention",
        choices=["sdpa", "flex"],
        default="sdpa",
        help="static engine: decode attention over the whole masked cache (sdpa) or over each "
        "row's own length (flex; needs --compile-decode)",
    )
    for phase in ("decode", "prefill"):
        p.add_argument(
            f"--{phase}-sdpa",
            metavar="BACKENDS",
            help=f"static engine: SDPA backends of the {phase} attention, e.g. efficient,math "
            "(default: torch's choice; benchmarks/decode_attention_speed.py compares them)",
        )


def _add_synthesize(sub: Any) -> None:
    y = sub.add_parser("synthesize", help="user prompts written by the target itself")
    y.add_argument("--model", default="asset:smollm2-135m-instruct", help="the target")
    y.add_argument("--tokenizer", help="defaults to --model")
    y.add_argument("--out", required=True, type=Path, help="JSONL of kept prompts (resumable)")
    y.add_argument(
        "--n", type=num.count(1, 10**9), required=True, help="prompts to sample (items 0..N-1)"
    )
    y.add_argument("--system", type=text, help="system prompt (default: the template's own)")
    y.add_argument("--topics", type=text, help="comma-separated hints, e.g. math,code,chat")
    y.add_argument("--temperature", type=num.temperature(), default=1.0)
    y.add_argument("--top-p", type=num.fraction(open_low=True), default=1.0)
    y.add_argument("--max-new-tokens", type=num.count(1, 1 << 20), default=256)
    y.add_argument("--min-chars", type=num.count(0, 1 << 24), default=12)
    y.add_argument("--max-chars", type=num.count(1, 1 << 24), default=4000)
    y.add_argument(
        "--near-duplicate", type=num.fraction(), default=0.7, help="word-trigram Jaccard"
    )
    y.add_argument("--thinking", choices=sorted(_THINKING), default="default")
    y.add_argument("--batch-size", type=num.count(1, 1 << 16), default=64, help="engine rows")
    y.add_argument(
        "--backend",
        choices=["static", "hf", "openai"],
        default="static",
        help="openai: an OpenAI-compatible server at --base-url serving --model",
    )
    _add_engine_options(y)
    add_server_arguments(y)
    y.add_argument("--device", default="auto", type=num.device(auto=True), help="auto, cpu, cuda:1")
    y.add_argument("--dtype", default="auto", choices=_DTYPES, help="auto: bf16 on GPU")
    y.add_argument("--seed", type=num.seed(), default=0)
    y.add_argument("--no-progress", action="store_true")


def _synthesize(args: argparse.Namespace) -> int:
    from dflash_trainer.outputs import check_not_input, output_file, writing

    args.out = output_file(args.out, "--out")
    check_not_input(args.out, "--out", [args.model, args.tokenizer])
    with writing(args.out, "dflash data synthesize", f"the synthesis output {args.out}"):
        return _synthesize_locked(args)


def _synthesize_locked(args: argparse.Namespace) -> int:
    from dflash_trainer.data.loading import load_causal_lm, load_tokenizer
    from dflash_trainer.data.synthesize import SynthSettings, synthesize

    topics = tuple(t.strip() for t in (args.topics or "").split(",") if t.strip())
    settings = SynthSettings(
        model=args.model,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        system=args.system,
        topics=topics,
        enable_thinking=_THINKING[args.thinking],
        min_chars=args.min_chars,
        max_chars=args.max_chars,
        near_duplicate=args.near_duplicate,
        backend=args.backend,
    )
    settings.check()
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    model, server = None, None
    if args.backend == "openai":
        from dflash_trainer.data.openai_backend import server_from_args

        server = server_from_args(args)
    else:
        model = load_causal_lm(args.model, _resolve_device(args.device), args.dtype)
    report = synthesize(
        model,
        tokenizer,
        args.out,
        args.n,
        settings,
        args.batch_size,
        progress=not args.no_progress,
        engine=_engine_options(args),
        server=server,
    )
    print(f"{args.out}: {report.format()} (counts in {args.out}.report.json)")
    if report.server:
        from dflash_trainer.data.openai_backend import server_line

        print(server_line(report.server))
    return 0


def _stats(args: argparse.Namespace) -> int:
    from dflash_trainer.data.shards import PreparedDataset, read_manifest
    from dflash_trainer.data.stats import check_png_path, dataset_stats, format_stats, plot_lengths

    if args.png is not None:
        args.png = check_png_path(args.png, "--png")
    if args.path.is_file():
        return prompts_cli.print_prompt_file_stats(args.path)
    manifest = read_manifest(args.path)
    splits = sorted(manifest["splits"]) if args.split == "all" else [args.split]
    for split in splits:
        ds = PreparedDataset(args.path, split)
        if args.verify:
            ds.verify()
        print(format_stats(dataset_stats(ds, args.budget), f"[{split}] {args.path}"))
        print()
        if args.png is not None and split == splits[0]:
            plot_lengths(ds.lengths, args.png, args.budget, f"{split} document lengths")
    if args.verify:
        print("checksums: all shards OK")
    if args.png is not None:
        print(f"wrote {args.png}")
    print(f"source {manifest['source']['spec']}, tokenizer {manifest['tokenizer']['name']}")
    prompts_cli.print_manifest_sources(manifest)
    return 0
