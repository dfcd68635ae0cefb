"""`dflash data prompts`: a prompt mixture from declared sources, decontaminated, in one file."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_trainer import cli_numbers as num
from dflash_trainer.data.decontam import (
    BUILTIN_EVALS,
    DEFAULT_NGRAM,
    RULES,
    build_index,
    parse_rules,
)
from dflash_trainer.data.near_dup import DEFAULT_CONTAINMENT

if TYPE_CHECKING:
    from dflash_trainer.lineage.turns import RecordedTurns


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "prompts", help="mix prompt sources (decontaminated) into one file for regenerate"
    )
    p.add_argument(
        "--sources",
        required=True,
        help="YAML with `sources:` (or a config with data.sources), or a shipped mixture name",
    )
    p.add_argument("--out", required=True, type=Path, help="the prompts JSONL to write")
    p.add_argument(
        "--decontam-evals",
        default=",".join(BUILTIN_EVALS),
        help=f"comma-separated built-in eval sets to decontaminate against "
        f"(default: all of {list(BUILTIN_EVALS)}; 'none' for none)",
    )
    p.add_argument(
        "--decontam-file",
        action="append",
        default=[],
        type=Path,
        help="also decontaminate against this JSON/JSONL file (repeatable)",
    )
    p.add_argument(
        "--decontam-rules",
        default=",".join(RULES),
        help=f"comma-separated decontamination rules (default: all of {','.join(RULES)})",
    )
    p.add_argument(
        "--ngram", type=num.count(1, 64), default=DEFAULT_NGRAM, help="n-gram size in words"
    )
    p.add_argument(
        "--near-dup-containment",
        type=num.fraction(open_low=True),
        default=DEFAULT_CONTAINMENT,
        help="share of an eval text's shingles a prompt must hold to be its near duplicate",
    )
    p.add_argument(
        "--seed", type=num.seed(), default=0, help="seed of the per-source order and caps"
    )
    add_exclude_lineage(p)


def add_exclude_lineage(p: Any) -> None:
    """`--exclude-lineage DIR`, the same on prompts, regenerate and prepare."""
    p.add_argument(
        "--exclude-lineage",
        metavar="DIR",
        action="append",
        default=[],
        help="leave out what this drafter's lineage (a drafter or run directory with "
        "lineage.json) trained on, per (prompt id, assistant turn): a conversation with turns "
        "after the recorded ones is kept for those, its earlier turns as context; repeatable",
    )


def lineage_turns(dirs: list[str]) -> RecordedTurns:
    """The (prompt id, assistant turn)s recorded in the lineages of `dirs` (hashes checked)."""
    from dflash_trainer.lineage.record import recorded_turns
    from dflash_trainer.lineage.turns import RecordedTurns

    out = RecordedTurns()
    for d in dirs:
        for pid, turns in recorded_turns(d).by_id.items():
            out.add(pid, turns)
    return out


def fresh_conversations(convs: list[Any], dirs: list[str], max_turns: int | None) -> list[Any]:
    """The conversations with a turn (among those regenerate answers) that the lineages of
    `dirs` did not train on; all their turns are answered, the earlier ones as context."""
    used = lineage_turns(dirs)
    fresh, later = [], 0
    for c in convs:
        users = sum(m["role"] == "user" for m in c.messages)
        if c.id in used:
            if not used.new_turns(c.id, min(users, max_turns or users)):
                continue
            later += 1
        fresh.append(c)
    print(
        f"left out {len(convs) - len(fresh)} conversations the lineage trained on every turn "
        f"of, kept {later} for their later turns ({len(used)} ids in {', '.join(dirs)})",
        file=sys.stderr,
    )
    return fresh


def run(args: argparse.Namespace) -> int:
    from dflash_trainer.outputs import check_not_input, output_file, writing

    args.out = output_file(args.out, "--out")
    check_not_input(args.out, "--out", [args.sources, *args.decontam_file])
    with writing(args.out, "dflash data prompts", f"the prompts file {args.out}"):
        return _run_locked(args, time.perf_counter())


def _run_locked(args: argparse.Namespace, t0: float) -> int:
    from dflash_trainer.data.mixture import (
        build_mixture,
        format_source_counts,
        load_sources,
        read_sidecar,
        write_mixture,
    )

    sources = load_sources(args.sources)
    evals = [e.strip() for e in args.decontam_evals.split(",") if e.strip()]
    if evals == ["none"]:
        evals = []
    index = None
    if evals or args.decontam_file:
        index = build_index(
            evals,
            args.decontam_file,
            args.ngram,
            parse_rules(args.decontam_rules),
            args.near_dup_containment,
        )
    exclude = lineage_turns(args.exclude_lineage)
    mix = build_mixture(sources, index, args.seed, exclude)
    meta: dict[str, Any] = {"sources_spec": str(args.sources), "seed": args.seed}
    if args.exclude_lineage:
        meta["excluded_by_lineage"] = {
            "lineages": [str(d) for d in args.exclude_lineage],
            "recorded_ids": len(exclude),
            "excluded": sum(r.in_lineage for r in mix.reports),
            "per_source": {r.name: r.in_lineage for r in mix.reports if r.in_lineage},
            "kept_for_later_turns": sum(r.later_turns for r in mix.reports),
            "later_turns_per_source": {r.name: r.later_turns for r in mix.reports if r.later_turns},
        }
    write_mixture(mix, args.out, meta)
    sidecar = read_sidecar(args.out)
    assert sidecar is not None
    print(format_source_counts(sidecar))
    if args.exclude_lineage:
        ex = meta["excluded_by_lineage"]
        print(f"left out {ex['excluded']:,} prompts the lineage trained on every turn of: "
              f"{ex['per_source']}; kept {ex['kept_for_later_turns']:,} for their later turns "
              f"(earlier turns as context): {ex['later_turns_per_source']}")  # fmt: skip
    print(
        f"wrote {args.out} ({len(mix.conversations):,} conversations), "
        f"{args.out.name}.sources.json and {args.out.name}.decontam.jsonl "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def print_prompt_file_stats(path: Path) -> int:
    """`dflash data stats prompts.jsonl`: the per-source counts of a mixed prompts file."""
    from dflash_trainer.data.mixture import format_source_counts, read_sidecar
    from dflash_trainer.errors import DFlashError

    sidecar = read_sidecar(path)
    if sidecar is None:
        raise DFlashError(
            f"{path} is a file without a {path.name}.sources.json next to it; "
            "`dflash data stats` reads a prepared directory or a file from `dflash data prompts`"
        )
    print(format_source_counts(sidecar))
    print(json.dumps({"sources_spec": sidecar.get("sources_spec"), "seed": sidecar.get("seed")}))
    return 0


def print_manifest_sources(manifest: dict[str, Any]) -> None:
    """Per-source documents and tokens of a prepared directory (and the mixture's counts)."""
    from dflash_trainer.data.mixture import format_prepared_sources, format_source_counts

    if manifest.get("sources"):
        print("\nper source (prepared documents):")
        print(format_prepared_sources(manifest["sources"]))
    if manifest.get("source_mixture"):
        print("\nper source (read by `dflash data prompts`):")
        print(format_source_counts(manifest["source_mixture"]))
