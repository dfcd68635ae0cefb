"""`dflash lineage show | verify | add-eval | init`: read and extend a drafter's lineage.

dflash lineage show DIR                       the continuations and cumulative totals
dflash lineage verify DIR [--last]            the hashes against the files beside them,
                                              no turn of a prompt trained twice (--last:
                                              by the last continuation)
dflash lineage add-eval DIR REPORT [--name N] served numbers after the last continuation
dflash lineage init DIR --prompts FILE ...    record how a drafter without a lineage
                                              was trained (its first continuation)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

from dflash_trainer import cli_numbers as num
from dflash_trainer.atomic_dir import write_file_atomic
from dflash_trainer.cli_paths import text
from dflash_trainer.data.shards import sha256_file
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import read_small_text
from dflash_trainer.lineage.record import (
    LINEAGE_FILE,
    PROMPTS_FILE,
    append,
    check_describes,
    lineage_dir,
    now,
    read_lineage,
    read_prompts,
    totals,
    weights_sha256,
    write_lineage,
)
from dflash_trainer.lineage.reuse import Retrained, retrained
from dflash_trainer.lineage.served import eval_entry
from dflash_trainer.lineage.summary import lineage_lines, replace_section
from dflash_trainer.lineage.turns import TurnsValue, count


def drafter_weights_sha256(path: str | Path) -> str:
    """The weights hash of the drafter at `path`, read as `dflash train --init-from` reads it
    (here, not in record.py: reading a drafter needs the formats package, which itself
    writes lineages)."""
    from dflash_trainer.formats.export import import_drafter

    return weights_sha256(import_drafter(path)[1])


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="lineage_command", metavar="{show,verify,add-eval,init}")
    s = sub.add_parser("show", help="the continuations and cumulative totals")
    s.add_argument("dir", help="drafter or run directory")
    s.add_argument("--json", action="store_true", help="print the totals as JSON")
    v = sub.add_parser("verify", help="check the weights and prompt-id hashes")
    v.add_argument("dir")
    v.add_argument(
        "--last",
        action="store_true",
        help="refuse only turns the last continuation trained on again (earlier continuations' "
        "recorded reuse is printed, not refused): the check after a new continuation of a "
        "drafter whose history already holds some",
    )
    a = sub.add_parser("add-eval", help="attach evaluation reports to the last continuation")
    a.add_argument("dir")
    a.add_argument("reports", nargs="+", help="eval.json, a headline JSON or a comparison JSON")
    a.add_argument("--name", type=text, help="the drafter's name in a side-by-side comparison JSON")
    a.add_argument(
        "--continuation",
        type=num.integer(0),
        help="attach to this continuation (default: the last, whose weights are in DIR); an "
        "earlier one's drafter measured again, e.g. the start drafter beside the new one",
    )
    i = sub.add_parser("init", help="record the training of a drafter that has no lineage")
    i.add_argument("dir", help="the drafter directory (a published drafter, an export)")
    i.add_argument(
        "--prompts",
        action="append",
        default=[],
        help="a JSONL file whose `id`s the drafter trained on (prompts or regenerated "
        "conversations; their turns are counted as assistant turns when present); repeatable",
    )
    i.add_argument("--steps", type=num.integer(0), required=True)
    i.add_argument(
        "--assistant-turns", type=num.integer(0), help="the trained turns, when known in total"
    )
    i.add_argument("--supervised-tokens", type=num.integer(0))
    i.add_argument("--documents", type=num.integer(0))
    i.add_argument("--note", default="", type=text, help="where the numbers come from")
    p.set_defaults(_lineage_parser=p)


def run(args: argparse.Namespace) -> int:
    cmd = getattr(args, "lineage_command", None)
    if cmd is None:
        args._lineage_parser.print_help()
        return 2
    handler = {"show": _show, "verify": _verify, "add-eval": _add_eval, "init": _init}[cmd]
    return handler(args)


def _need(path: str) -> tuple[Path, dict[str, Any]]:
    lineage = read_lineage(path)
    d = lineage_dir(path)
    if lineage is None or d is None:
        raise DFlashError(
            f"{path}: no {LINEAGE_FILE} (nor {path}/drafter/{LINEAGE_FILE}); runs write one "
            "into their drafter/, exports carry it, `dflash lineage init` starts one"
        )
    return d, lineage


def _show(args: argparse.Namespace) -> int:
    d, lineage = _need(args.dir)
    try:
        prompts = read_prompts(d)
    except DFlashError as e:  # the continuations still read; `verify` refuses the files
        print(f"dflash lineage show: prompt ids not read, so not checked for turns trained "
              f"twice: {e}", file=sys.stderr)  # fmt: skip
        prompts = None
    if args.json:
        # The totals count a re-trained turn once per continuation that trained on it;
        # "retrained" says which (null: the prompt ids could not be read to tell).
        again = None if prompts is None else [
            {"later": r.later, "earlier": r.earlier, "prompts": r.reuse.prompts,
             "turns": r.reuse.turns, "every_turn_prompts": r.reuse.every_turn,
             "how": r.reuse.details()}
            for r in retrained(prompts)
        ]  # fmt: skip
        print(json.dumps({**totals(lineage), "retrained": again}, indent=1))
        return 0
    print(f"{d / LINEAGE_FILE}")
    print("\n".join(lineage_lines(lineage, prompts)[2:]))
    return 0


def _verify(args: argparse.Namespace) -> int:
    d, lineage = _need(args.dir)
    prompts = read_prompts(d)  # raises on a prompt-id hash mismatch
    h = drafter_weights_sha256(d)
    check_describes(lineage, h, str(d))
    conts = lineage["continuations"]
    for prev, c in pairwise(conts):
        start = (c.get("start") or {}).get("weights_sha256")
        known = {(prev.get("result") or {}).get("weights_sha256")}
        known |= {e.get("weights_sha256") for e in prev.get("exports") or []}
        if start not in known:
            raise DFlashError(
                f"{d / LINEAGE_FILE}: continuation {c['index']} starts from weights {start} "
                f"that continuation {prev['index']} neither produced nor exported"
            )
    seen = _no_turn_twice(prompts, d / LINEAGE_FILE, len(conts) - 1 if args.last else None)
    print(
        f"{d}: lineage OK ({len(conts)} continuations, {len(seen):,} distinct prompt ids, "
        f"weights sha256 {h[:16]}... match the last continuation)"
    )
    return 0


def _no_turn_twice(
    prompts: list[dict[str, TurnsValue]], where: Path, only_later: int | None = None
) -> dict[str, list[int]]:
    """Refuse a lineage in which two continuations trained on the same (prompt id, assistant
    turn), ids matched across a source prefix too (lineage/reuse.py); a later continuation may
    train on a prompt's later turns. `only_later`: refuse only that continuation's reuse and
    print the rest (a history cannot be retrained; the rule binds each new continuation).
    {id: the continuations recording it}."""
    again: list[Retrained] = []
    recorded: list[Retrained] = []
    for r in retrained(prompts):
        (again if only_later is None or r.later == only_later else recorded).append(r)
    for r in recorded:
        print(f"{where}: recorded earlier: {r.pair_text()}", file=sys.stderr)
    if again:
        pairs = "; ".join(r.pair_text() for r in again)
        raise DFlashError(
            f"{where}: a continuation trained on turns an earlier one had trained on: {pairs}. "
            "The record is what those weights saw and stays as it is (`dflash lineage show` "
            "and the model card say it); for the next continuation, `dflash data prepare "
            "--exclude-lineage` leaves these turns out and `dflash train` refuses them"
        )
    seen: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        for pid in p:
            seen.setdefault(pid, []).append(i)
    return seen


def _locked(path: str, command: str) -> contextlib.AbstractContextManager[None]:
    """The lock of the drafter directory whose lineage a command rewrites: two `add-eval`s at
    once would each read the lineage, add their report and write it back, losing one."""
    from dflash_trainer.outputs import writing

    d = lineage_dir(path) or Path(path)
    return writing(d, f"dflash lineage {command}", f"the lineage of {d}")


def _add_eval(args: argparse.Namespace) -> int:
    with _locked(args.dir, "add-eval"):
        return _add_eval_locked(args)


def _add_eval_locked(args: argparse.Namespace) -> int:
    d, lineage = _need(args.dir)
    check_describes(lineage, drafter_weights_sha256(d), str(d))
    if not lineage["continuations"]:
        raise DFlashError(f"{d / LINEAGE_FILE}: no continuation to attach the evaluation to")
    entries = [eval_entry(r, args.name) for r in args.reports]  # all read before a write
    conts = lineage["continuations"]
    index = len(conts) - 1 if args.continuation is None else args.continuation
    if not 0 <= index < len(conts):
        raise DFlashError(f"--continuation {index}: the lineage has 0..{len(conts) - 1}")
    last = conts[index]
    last.setdefault("evals", []).extend(entries)
    prompts = read_prompts(d)
    write_lineage(d, lineage, prompts)
    card = d / "README.md"
    if card.is_file() and not card.is_symlink():  # the model card of an export
        text = read_small_text(card, "model card")
        write_file_atomic(card, replace_section(text, lineage_lines(lineage, prompts)))
    print(f"{d / LINEAGE_FILE}: {len(entries)} evaluation(s) attached to continuation "
          f"{last['index']}")  # fmt: skip
    return 0


def prompt_turns(path: str | Path) -> dict[str, TurnsValue]:
    """{id: assistant turns (None when the record has no answers)} of a JSONL file."""
    from dflash_trainer.data.jsonio import iter_jsonl

    out: dict[str, TurnsValue] = {}
    for row in iter_jsonl(Path(path)):
        if not isinstance(row, dict) or not isinstance(row.get("id"), str):
            raise DFlashError(f"{path}: every line needs a string `id` (a prompts file)")
        turns = sum(m.get("role") == "assistant" for m in row.get("messages") or [])
        out[row["id"]] = turns or None
    return out


def _init(args: argparse.Namespace) -> int:
    with _locked(args.dir, "init"):
        return _init_locked(args)


def _init_locked(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    existing = read_lineage(d)
    lineage, all_prompts = _init_record(args, d)
    if existing is not None:
        # A rerun of the same `init` (a script run twice) is done already; other numbers
        # would rewrite what the drafter is recorded to have trained on: refused.
        _check_same_init(d, existing, read_prompts(d), lineage, all_prompts)
        print(f"{d / LINEAGE_FILE}: already records this training; nothing to do")
        return 0
    write_lineage(d, lineage, all_prompts)
    print(f"{d / LINEAGE_FILE}: started with {len(all_prompts[0]):,} recorded prompt ids")
    return 0


def _init_record(args: argparse.Namespace, d: Path) -> tuple[dict[str, Any], list[Any]]:
    """The lineage `init` writes for `args`: one continuation, recorded after training."""
    h = drafter_weights_sha256(d)
    prompts: dict[str, TurnsValue] = {}
    for f in args.prompts:
        prompts.update(prompt_turns(f))
    counted = [t for t in prompts.values() if t is not None]
    sources: dict[str, dict[str, int]] = {}
    for pid in prompts:  # `<source>/<id>` of `dflash data prompts`
        head, sep, _ = pid.partition("/")
        row = sources.setdefault(head if sep else "-", {"prompt_ids": 0})
        row["prompt_ids"] += 1
    data = {
        "documents": args.documents,
        "assistant_turns": args.assistant_turns
        if args.assistant_turns is not None
        else (sum(map(count, counted)) if counted else None),
        "supervised_tokens": args.supervised_tokens,
        "sources": dict(sorted(sources.items())),
        # Name and content hash, never the path: where the files lay on the training machine
        # (often a scratch directory) says nothing a reader of the card can use.
        "prompt_files": [
            {"name": Path(f).name, "sha256": sha256_file(Path(f))} for f in args.prompts
        ],
        "note": args.note,
    }
    continuation = {
        "date": now(),
        "recorded_after_training": True,
        "start": {"init_from": None, "weights_sha256": None},
        "steps": args.steps,
        "data": data,
        "result": {"weights_sha256": h, "dtype": None},
        "exports": [],
        "evals": [],
    }
    lineage, all_prompts = append(None, [], continuation, prompts if prompts else None)
    return json.loads(json.dumps(lineage)), all_prompts


_NOT_COMPARED = ("date", "exports", "evals")
"""What a rerun of `init` may find changed: when it ran, and what was attached since."""


def _check_same_init(
    d: Path, old: dict[str, Any], old_prompts: list[Any], new: dict[str, Any], prompts: list[Any]
) -> None:
    """Refuse unless the lineage at `d` starts with the continuation `new` records."""
    first = old["continuations"][0] if old["continuations"] else {}
    mine = new["continuations"][0]
    differ = [
        k for k in sorted({*first, *mine} - set(_NOT_COMPARED)) if first.get(k) != mine.get(k)
    ]
    if "data" in differ:
        a, b = first.get("data") or {}, mine["data"]
        differ[differ.index("data")] = ", ".join(
            f"data.{k}" for k in sorted({*a, *b}) if a.get(k) != b.get(k)
        )
    if not differ and (old_prompts[:1] or [{}])[0] != prompts[0]:
        differ = ["the prompt ids"]
    if len(old["continuations"]) > 1:
        differ.append(f"{len(old['continuations'])} continuations recorded there, 1 here")
    if differ:
        raise DFlashError(
            f"{d}: already has a {LINEAGE_FILE} that records other training ({'; '.join(differ)}"
            f" differ from these arguments); `init` only starts a lineage: give the same "
            f"arguments, or remove {LINEAGE_FILE} and {PROMPTS_FILE} there to record it anew"
        )
