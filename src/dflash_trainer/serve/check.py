"""`dflash serve-check`: the drafter served by vLLM, measured where users deploy it.

What it does (docs/serving.md):
1. runs `dflash eval` in this process on the prompt sets (greedy, with the target-alone
   baseline): its pooled tau and each turn's answer, which the lossless check proves equal to
   the target's own greedy answer;
2. exports the drafter with `dflash export --to zlab` to a temporary directory, saves a GGUF
   target as a plain HF directory (vLLM reads neither our files nor a dequantised GGUF), and
   starts vLLM's OpenAI server on them (vllm_server.py), or uses `--base-url`;
3. sends the same conversations turn by turn (the prompt ids `dflash eval` renders, greedy,
   the same stop ids and max_new_tokens), reading vLLM's acceptance counters before and after
   each prompt set (metrics.py): vllm_tau = 1 + accepted / drafts;
4. writes a JSON report, per prompt set: {"vllm_tau", "dflash_eval_tau", "greedy_equal",
   "prompts", ...}; greedy_equal counts conversations whose every served answer equals the
   target's greedy answer token for token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_trainer import cli_numbers as num
from dflash_trainer.cli_paths import text
from dflash_trainer.data.openai_client import OpenAIClient
from dflash_trainer.errors import DFlashError
from dflash_trainer.serve.served import (
    compare_set,
    needs_plain_copy,
    plain_target_dir,
    serve_conversations,
    temp_dir,
)
from dflash_trainer.serve.vllm_server import VLLMServer, vllm_python, vllm_version


def _say(message: str) -> None:
    print(f"dflash serve-check: {message}", file=sys.stderr, flush=True)


def evaluate_sets(
    args: argparse.Namespace, models: Any = None
) -> tuple[Any, list[Any], dict[str, Any]]:
    """(the eval models, the prompt sets, label -> `dflash eval`'s greedy result with the
    target-alone baseline)."""
    from dflash_trainer.config import EvalConfig
    from dflash_trainer.eval.evaluate import evaluate_prompts
    from dflash_trainer.eval.loading import load_eval_models
    from dflash_trainer.eval.prompts import load_prompt_set, set_label

    cfg = EvalConfig(
        prompts=tuple(s for s in args.prompts.split(",") if s),
        max_samples=args.max_samples or None,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0,
        seed=args.seed,
    )
    sets = [load_prompt_set(name, cfg.max_samples, cfg.seed) for name in cfg.prompts]
    if models is None:
        models = load_eval_models(args.drafter, args.target, args.dtype, "cpu")
    results: dict[str, Any] = {}
    for ps in sets:
        t0 = time.perf_counter()
        results[set_label(ps.name)] = evaluate_prompts(
            models.drafter,
            models.target,
            models.tokenizer,
            [p.messages for p in ps.prompts],
            cfg,
            baseline=True,
            prompt_ids=[p.id for p in ps.prompts],
        )
        _say(f"dflash eval on {set_label(ps.name)}: {time.perf_counter() - t0:.0f} s")
    return models, sets, results


def server_args(spec: Any, drafter_dir: Path, args: argparse.Namespace) -> list[str]:
    """vLLM's flags: the drafter as a DFlash speculator drafting block_size - 1 tokens."""
    config = {
        "method": "dflash",
        "model": str(drafter_dir),
        "num_speculative_tokens": spec.block_size - 1,
    }
    return [
        "--speculative-config", json.dumps(config),
        "--enforce-eager",  # startup ~1 min instead of ~5 on CPU: no graph capture
        "--dtype", args.dtype,
        "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30)),
        "--max-model-len", str(args.max_model_len),
    ]  # fmt: skip


def _serve_sets(
    client: OpenAIClient, root: str, models: Any, sets: list[Any], args: argparse.Namespace
) -> dict[str, Any]:
    from dflash_trainer.eval.prompt_run import stop_token_ids
    from dflash_trainer.eval.prompts import set_label

    stops = stop_token_ids(models.tokenizer, models.target.model)
    served = {}
    for ps in sets:
        t0 = time.perf_counter()
        served[set_label(ps.name)] = serve_conversations(
            client,
            models.tokenizer,
            [p.messages for p in ps.prompts],
            args.max_new_tokens,
            stops,
            server_root=root,
        )
        _say(f"served {set_label(ps.name)}: {time.perf_counter() - t0:.0f} s")
    return served


def _only_model(base_url: str) -> str:
    served = OpenAIClient(base_url, "").get_json("/models")
    names = [m["id"] for m in served.get("data", [])]
    if len(names) != 1:
        raise DFlashError(f"{base_url} serves {names}: pass --model NAME")
    return str(names[0])


@contextlib.contextmanager
def local_server(
    models: Any, args: argparse.Namespace, python: Path
) -> Iterator[tuple[VLLMServer, Any]]:
    """vLLM serving the eval's target with the drafter exported by `dflash export --to zlab`
    (a GGUF target saved as a plain HF directory first), in a temporary directory removed
    afterwards; the server is stopped on every way out of the block."""
    from dflash_trainer.assets import serving_name
    from dflash_trainer.formats.export import export_drafter

    with temp_dir() as tmp:
        name = models.identity["target"]["name_or_path"]
        target_dir = name
        if needs_plain_copy(name, models.identity["target"].get("gguf_file")):
            _say(f"saving the target {name} as a plain HF directory for vLLM")
            target_dir = str(
                plain_target_dir(models.target.model, models.tokenizer, Path(tmp) / "target")
            )
        export = export_drafter(
            args.drafter, Path(tmp) / "drafter", "zlab", args.dtype, args.target
        )
        server = VLLMServer(
            python,
            target_dir,
            serving_name(name) or "target",
            server_args(models.drafter.spec, export.path, args),
            log_path=args.log or Path(tmp) / "vllm.log",
            startup_timeout=args.startup_timeout,
        )
        _say(f"starting vLLM: {' '.join(server.command)}")
        t0 = time.perf_counter()
        with server:
            _say(f"vLLM ready after {time.perf_counter() - t0:.0f} s")
            yield server, export


def run_check(args: argparse.Namespace, models: Any = None) -> dict[str, Any]:
    """The report of one check (check.py's module docstring); `models` (eval.loading's
    EvalModels) when already loaded."""
    python = None if args.base_url else vllm_python(args.vllm_python)  # fail before the eval
    client = None
    if args.base_url:  # a server that is not there fails now, not after the whole eval
        client = OpenAIClient(args.base_url, args.model or _only_model(args.base_url))
        client.check_model()
    models, sets, evaluated = evaluate_sets(args, models)
    report: dict[str, Any] = {"drafter": str(args.drafter), "target": models.identity["target"]}
    report["settings"] = {
        "prompts": args.prompts, "max_samples": args.max_samples, "seed": args.seed,
        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "temperature": 0.0,
    }  # fmt: skip
    if client is not None:
        served = _serve_sets(client, client.base_url.removesuffix("/v1"), models, sets, args)
        report["server"] = {"base_url": client.base_url, "model": client.model}
    else:
        assert python is not None
        with local_server(models, args, python) as (server, export):
            client = OpenAIClient(server.base_url, server.served_name, timeout=1800)
            served = _serve_sets(client, server.root, models, sets, args)
        report["server"] = {
            "command": server.command,
            "vllm": vllm_version(python),
            "card_commands": export.commands,
        }
    report["sets"] = {
        _label(ps): compare_set(
            served[_label(ps)], evaluated[_label(ps)], [p.id for p in ps.prompts]
        )
        for ps in sets
    }
    return report


def _label(ps: Any) -> str:
    from dflash_trainer.eval.prompts import set_label

    return str(set_label(ps.name))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="run dir, checkpoint or export")
    p.add_argument("--target", help="default: the target recorded with the drafter")
    p.add_argument("--prompts", default="gsm8k", help="comma list, as `dflash eval --prompts`")
    p.add_argument("--max-samples", type=num.count(0), default=10, help="prompts per set (0 = all)")
    p.add_argument("--max-new-tokens", type=num.count(1, 1 << 20), default=128)
    p.add_argument(
        "--seed", type=num.seed(), default=0, help="the prompt subset, as in `dflash eval`"
    )
    p.add_argument("--out", type=Path, default=Path("serve_check.json"), help="the JSON report")
    p.add_argument(
        "--base-url",
        help="a vLLM server already serving the target with this drafter (e.g. "
        "http://host:8000/v1); default: start one here",
    )
    p.add_argument(
        "--model", type=text, help="with --base-url: the served model name (default: its only one)"
    )
    p.add_argument("--vllm-python", help="the vLLM virtualenv's python (default: .venv-vllm)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="target and drafter dtype on both sides",
    )
    p.add_argument("--startup-timeout", type=num.positive(86400.0), default=900.0, help="seconds")
    p.add_argument(
        "--kv-cache-gib",
        type=num.positive(4096.0),
        default=1.0,
        help="vLLM's KV cache size (CPU backend)",
    )
    p.add_argument("--max-model-len", type=num.count(16, 1 << 24), default=4096)
    p.add_argument("--log", type=Path, help="keep the server's log here (default: a temp file)")


def run(args: argparse.Namespace) -> int:
    from dflash_trainer.eval.report import write_json
    from dflash_trainer.outputs import output_file, writing

    args.out = output_file(args.out, "--out")
    # Held for the whole check, like eval's: one check writes a report at a time, and the
    # export it serves (locked in turn) is not mistaken for the command's last output.
    with writing(args.out, "dflash serve-check", f"the report {args.out}"):
        report = run_check(args)
        write_json(report, args.out)  # atomic: a check cut short leaves the previous report
    for label, s in report["sets"].items():
        print(
            f"{label}: vLLM tau {_num(s['vllm_tau'])}, dflash eval tau {_num(s['dflash_eval_tau'])}"
            f", greedy equal {s['greedy_equal']}/{s['prompts']} prompts"
        )
    print(
        f"dflash serve-check: wrote {args.out} ({time.strftime('%Y-%m-%d %H:%M')})", file=sys.stderr
    )
    return 0


def _num(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, int | float) else "-"
