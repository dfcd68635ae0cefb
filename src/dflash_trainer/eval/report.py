"""Metrics and reports of `dflash eval`: pure metric functions over per-step acceptance
counts and `Generation`s; one JSON document, a Markdown table, two PNG plots.

The JSON holds everything (config, drafter and target identity, environment, every metric
per prompt set, every response); the Markdown and the plots are views of it, so a report
can be re-rendered from the JSON alone (`markdown(json.load(f))`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_trainer.atomic_dir import save_png, write_file_atomic
from dflash_trainer.config import EvalConfig
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import read_small_bytes

if TYPE_CHECKING:
    from dflash_trainer.eval.speculative import Generation


def acceptance_metrics(accepted: Sequence[Sequence[int]], block_size: int) -> dict[str, Any]:
    """tau (both conventions), histogram and per-position acceptance from per-step counts.

    `accepted[r]` lists response r's steps (drafts accepted, 0..B-1). A response without a
    step (it stopped at its first token) has no tau and is left out of the z-lab mean.
    """
    steps = [a for resp in accepted for a in resp]
    per_response = [sum(a + 1 for a in resp) / len(resp) for resp in accepted if resp]
    hist = [0] * block_size
    for a in steps:
        hist[a] += 1
    # Slot k (1-based) is reached when the k-1 slots before it were accepted.
    reached = [sum(hist[k - 1 :]) for k in range(1, block_size)]
    taken = [sum(hist[k:]) for k in range(1, block_size)]
    return {
        "block_size": block_size,
        "num_steps": len(steps),
        "tau": sum(per_response) / len(per_response) if per_response else float("nan"),
        "tau_pooled": sum(a + 1 for a in steps) / len(steps) if steps else float("nan"),
        "accepted_histogram": hist,
        "accepted_fraction": [h / len(steps) if steps else float("nan") for h in hist],
        "per_position_acceptance": [t / r if r else float("nan") for t, r in zip(taken, reached)],
    }


def speed_metrics(gens: Sequence[Generation]) -> dict[str, Any]:
    """Decode tokens/s and TPOT pooled over responses (prefill excluded), plus z-lab's mean TPOT."""
    tokens = sum(g.decode_tokens for g in gens)
    seconds = sum(g.decode_s for g in gens)
    tpots = [g.tpot_s for g in gens if g.decode_tokens]
    return {
        "generated_tokens": sum(len(g.tokens) for g in gens),
        "decode_tokens": tokens,
        "decode_s": seconds,
        "prefill_s": sum(g.prefill_s for g in gens),
        "decode_tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
        "tpot_ms": 1000 * seconds / tokens if tokens else float("nan"),
        "mean_tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else float("nan"),
        "target_forwards": sum(g.target_forwards for g in gens),
    }


def lossless_check(spec: Generation, base: Generation) -> dict[str, Any]:
    """Equality of two greedy outputs; where they first differ and the target's margin there."""
    n = min(len(spec.tokens), len(base.tokens))
    first = next((i for i in range(n) if spec.tokens[i] != base.tokens[i]), None)
    if first is None and len(spec.tokens) != len(base.tokens):
        first = n
    margin = None
    if first is not None and base.margins is not None and first < len(base.margins):
        margin = base.margins[first]
    return {"match": first is None, "first_mismatch": first, "target_margin": margin}


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def summarize(
    responses: list[dict[str, Any]],
    spec_gens: Sequence[Generation],
    base_gens: Sequence[Generation],
    block_size: int,
    greedy: bool,
) -> dict[str, Any]:
    """A prompt set's metrics (flat keys first) from its responses and both runs' generations."""
    out: dict[str, Any] = {"num_responses": len(responses)}
    out.update(acceptance_metrics([g.accepted for g in spec_gens], block_size))
    spec = speed_metrics(spec_gens)
    out["speculative"] = spec
    out["decode_tokens_per_s"] = spec["decode_tokens_per_s"]
    if base_gens:
        base = speed_metrics(base_gens)
        out["baseline"] = base
        out["baseline_decode_tokens_per_s"] = base["decode_tokens_per_s"]
        out["speedup"] = _ratio(base["tpot_ms"], spec["tpot_ms"])
        out["speedup_mean_tpot"] = _ratio(base["mean_tpot_ms"], spec["mean_tpot_ms"])
        if greedy:
            bad = [r for r in responses if not r["lossless"]["match"]]
            out["lossless_mismatches"] = len(bad)
            out["mismatched"] = [
                {"prompt": r["prompt"], "turn": r["turn"], **r["lossless"]} for r in bad
            ]
    out["responses"] = responses
    return out


# ----------------------------------------------------------------------------- reports


def _clean(value: Any) -> Any:
    """JSON-safe: NaN / inf -> null (json.dump would write invalid `NaN`), tuples -> lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def build_report(
    results: dict[str, dict[str, Any]],
    cfg: EvalConfig,
    identity: dict[str, Any],
    args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    report = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "arguments": {k: v for k, v in (args or {}).items() if not k.startswith("_")},
        "config": dataclasses.asdict(cfg),
        **identity,
        "sets": results,
    }
    cleaned: dict[str, Any] = _clean(report)
    return cleaned


def write_json(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written next to the destination and renamed: a run killed mid-write (a timeout, a
    # preempted job) leaves the previous report, never half of one.
    return write_file_atomic(path, json.dumps(_clean(report), indent=2, allow_nan=False) + "\n")


def is_report(path: Path) -> bool:
    """Whether `path` holds a JSON report of this tool (a `dflash eval` or serve-check one)."""
    try:
        data = json.loads(read_small_bytes(path, "report"))
    except (DFlashError, OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "sets" in data and "created" in data


def check_report_path(path: Path, flag: str) -> None:
    """Refuse to replace a file that is not a report of ours (the drafter's meta.json given
    as --json by mistake is never overwritten)."""
    if os.path.lexists(path) and not is_report(path):
        raise DFlashError(
            f"{flag} {path} exists and is not a report written by this tool; nothing was "
            "replaced: give another path or move the file aside"
        )


def _fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def _lossless(res: dict[str, Any]) -> str:
    if "lossless_mismatches" not in res:
        return "-"
    bad = res["lossless_mismatches"]
    return "ok" if bad == 0 else f"{bad} MISMATCH"


def markdown(report: dict[str, Any]) -> str:
    """The summary table plus acceptance by slot position, per prompt set."""
    cfg = report.get("config", {})
    target = report.get("target", {}).get("name_or_path", "?")
    drafter = report.get("drafter", {}).get("path", "?")
    lines = [
        f"DFlash eval: drafter `{drafter}` on target `{target}`, temperature "
        f"{cfg.get('temperature')}, top_p {cfg.get('top_p')}, max_new_tokens "
        f"{cfg.get('max_new_tokens')}",
        "",
        "| set | prompts | responses | tau (z-lab) | tau (pooled) | spec tok/s | target tok/s "
        "| speedup | lossless |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, res in report["sets"].items():
        lines.append(
            f"| {name} | {res.get('num_prompts', '-')} | {res['num_responses']} "
            f"| {_fmt(res.get('tau'))} | {_fmt(res.get('tau_pooled'))} "
            f"| {_fmt(res.get('decode_tokens_per_s'), 1)} "
            f"| {_fmt(res.get('baseline_decode_tokens_per_s'), 1)} "
            f"| {_fmt(res.get('speedup'), 2, 'x')} | {_lossless(res)} |"
        )
    lines += ["", "P(slot k accepted | slot k reached), k = 1..B-1:", ""]
    for name, res in report["sets"].items():
        rates = " ".join(_fmt(r, 2) for r in res.get("per_position_acceptance", []))
        lines.append(f"- {name}: {rates}")
    return "\n".join(lines) + "\n"


def plot_acceptance_histogram(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = report["sets"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(sets), 1)
    for i, (name, res) in enumerate(sets.items()):
        frac = [f or 0.0 for f in res["accepted_fraction"]]
        xs = [k + (i - (len(sets) - 1) / 2) * width for k in range(len(frac))]
        ax.bar(xs, frac, width=width, label=f"{name} (tau {_fmt(res.get('tau'))})")
    ax.set_xlabel("drafts accepted per step (tau - 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Acceptance histogram")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path


def plot_tau_per_set(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["sets"])
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(names) + 2), 4))
    for j, (key, label) in enumerate((("tau", "tau (z-lab)"), ("tau_pooled", "tau (pooled)"))):
        vals = [report["sets"][n].get(key) or 0.0 for n in names]
        ax.bar([i + (j - 0.5) * 0.38 for i in range(len(names))], vals, width=0.38, label=label)
    for i, n in enumerate(names):
        res = report["sets"][n]
        speedup = res.get("speedup")
        if speedup:
            top = max(res.get("tau") or 0.0, res.get("tau_pooled") or 0.0)
            ax.annotate(f"speedup {speedup:.2f}x", (i, top), xytext=(0, 4),
                        textcoords="offset points", ha="center", fontsize=8)  # fmt: skip
    block = max((r.get("block_size") or 1 for r in report["sets"].values()), default=1)
    ax.set_ylim(0, block * 1.15)  # tau is at most the block size
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("accepted + 1 per step")
    ax.set_title("tau per prompt set")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path


def write_all(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """eval.json, eval.md, acceptance_histogram.png, tau_per_set.png in `out_dir`, each
    written whole; eval.json, which the others are views of, last."""
    out_dir.mkdir(parents=True, exist_ok=True)
    views = [
        plot_acceptance_histogram(report, out_dir / "acceptance_histogram.png"),
        plot_tau_per_set(report, out_dir / "tau_per_set.png"),
        write_file_atomic(out_dir / "eval.md", markdown(report)),
    ]
    return [write_json(report, out_dir / "eval.json"), views[2], *views[:2]]
