"""A drafter's lineage: every continuation that made its weights, in order.

A drafter directory (a run's `drafter/`, an export, a published drafter) may hold

    lineage.json               {"format": "dflash-lineage", "version": 1, "continuations": [...]}
    lineage_prompts.jsonl.gz   one line per continuation: {"index": i, "prompts": {id: turns}}

`turns` are the assistant turns of the prompt that continuation supervised (lineage/turns.py:
n for turns 1..n, a list, or null for all of them); a later continuation may supervise the
prompt's other turns.

One continuation is one training run: where it started (the start drafter's weights hash,
none for a drafter trained from scratch), its data (prepared directory and fingerprint,
documents, assistant turns, supervised tokens, per-source counts, the prompt ids it trained
on), its steps and full resolved config (enough to replay it), the hash of the weights it
ended with, the hash of each export of them, and the served numbers attached after it
(`dflash lineage add-eval`). A run started from a drafter with a lineage inherits it and
appends its own continuation, so the file always describes the weights beside it.

Weights hashes are over the tensors, not the file bytes: sha256 of every tensor's name,
dtype, shape and raw bytes in name order, so the same weights hash alike in the project's
files and in an export, and a cast (fp32 run -> bf16 export) is a new hash, recorded as the
export's. Prompt ids are hashed per continuation (sorted canonical JSON of {id: turns}); both
hashes are checked whenever the lineage is read for exclusion or verified.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.atomic_dir import write_file_atomic
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import inside, open_input
from dflash_trainer.json_input import parse_json, read_json
from dflash_trainer.lineage.turns import RecordedTurns, TurnsValue, value_problem

LINEAGE_FILE = "lineage.json"
PROMPTS_FILE = "lineage_prompts.jsonl.gz"
LINEAGE_FILES = frozenset({LINEAGE_FILE, PROMPTS_FILE})
FORMAT = "dflash-lineage"
VERSION = 2
"""The newest version this tool reads. A lineage is written as version 1 (what older tools
read) until a continuation records turns that are not 1..n, which only version 2 has."""
TURN_LISTS = 2

Lineage = dict[str, Any]
PromptTurns = dict[str, TurnsValue]
"""Prompt id -> assistant turns trained on (lineage/turns.py: n, a list, or None for all)."""


# ------------------------------------------------------------------------------- hashes


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def prompts_sha256(prompts: Mapping[str, TurnsValue]) -> str:
    text = json.dumps(dict(sorted(prompts.items())), separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ------------------------------------------------------------------------- read / write


def empty() -> Lineage:
    return {"format": FORMAT, "version": 1, "continuations": []}


def lineage_dir(path: str | Path) -> Path | None:
    """The directory holding the lineage of the drafter at `path` (a drafter directory, or a
    run directory with a final `drafter/`); None when there is none. A lineage.json that is
    there but is not a regular file is found here and refused by `read_lineage`."""
    p = Path(path)
    for d in (p, p / "drafter"):
        if os.path.lexists(d / LINEAGE_FILE):
            return d
    return None


def read_lineage(path: str | Path) -> Lineage | None:
    """The lineage of the drafter at `path`, checked for its shape; None when it has none."""
    d = lineage_dir(path)
    if d is None:
        return None
    where = inside(d, LINEAGE_FILE, "lineage")  # a link out of the drafter is not its record
    data = read_json(where, "lineage")
    if data.get("format") != FORMAT or not isinstance(data.get("continuations"), list):
        raise DFlashError(f"{where}: not a dflash lineage (format {FORMAT!r} with continuations)")
    version = data.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version > VERSION:
        raise DFlashError(f"{where}: lineage version {version!r:.40} is not one this tool reads "
                          f"(<= {VERSION}): a newer tool wrote it, or it is damaged")  # fmt: skip
    for i, c in enumerate(data["continuations"]):
        problem = _continuation_problem(c, i)
        if problem:
            raise DFlashError(f"{where}: continuation {i} is damaged ({problem}); restore the "
                              "lineage files from the drafter's source")  # fmt: skip
    return dict(data)


_COUNTS = ("documents", "assistant_turns", "supervised_tokens", "tokens")


def _continuation_problem(c: Any, i: int) -> str | None:
    """What is wrong with continuation `i`'s shape (the fields every reader uses), or None."""
    if not isinstance(c, dict) or c.get("index") != i:
        return "not an object with its index, or out of order"
    for key, kind in (("data", dict), ("result", dict), ("start", dict)):
        if c.get(key) is not None and not isinstance(c[key], kind):
            return f"{key} is not an object"
    for key in ("exports", "evals"):
        items = c.get(key)
        if items is not None and not (
            isinstance(items, list) and all(isinstance(e, dict) for e in items)
        ):
            return f"{key} is not a list of objects"
    for key in ("start", "result", "exports"):
        value = c.get(key)
        entries: list[Any] = value if isinstance(value, list) else [value or {}]
        if not all(isinstance(e.get("weights_sha256"), str | None) for e in entries):
            return f"{key}: weights_sha256 is not a string"
    data = c.get("data") or {}
    for key, value in [("steps", c.get("steps")), *((k, data.get(k)) for k in _COUNTS)]:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{key} is {value!r:.40}, not a count"
    sources = data.get("sources")
    if sources is not None and not (
        isinstance(sources, dict) and all(isinstance(r, dict) for r in sources.values())
    ):
        return "data.sources is not a map of per-source counts"
    ids = data.get("prompt_ids")
    if ids is not None and not (
        isinstance(ids, dict) and isinstance(ids.get("count"), int)
        and isinstance(ids.get("sha256"), str)
    ):  # fmt: skip
        return "data.prompt_ids is not {count, sha256}"
    return None


def _prompt_lines(f: Path) -> dict[int, PromptTurns]:
    """{index: {prompt id: turns}} of a lineage_prompts file (decompressed with a bound)."""
    lines: dict[int, PromptTurns] = {}
    try:
        with open_input(f, "lineage prompts") as raw:
            for n, line in enumerate(raw, 1):
                row = parse_json(line, f"{f}: line {n}", dict)
                index, prompts = row.get("index"), row.get("prompts")
                if not isinstance(index, int) or not isinstance(prompts, dict):
                    raise DFlashError(f"{f}: line {n} is not {{index, prompts}}")
                bad = next(((k, p) for k, v in prompts.items() if (p := value_problem(v))), None)
                if bad is not None:
                    raise DFlashError(f"{f}: line {n}: the turns of prompt {bad[0]!r:.80} are "
                                      f"damaged ({bad[1]}); restore the lineage files from the "
                                      "drafter's source")  # fmt: skip
                lines[index] = dict(prompts)
    except (OSError, EOFError, zlib.error) as e:  # gzip: damaged or cut short
        raise DFlashError(f"{f}: not a readable gzip file ({type(e).__name__}: {e})") from e
    return lines


def read_prompts(path: str | Path) -> list[PromptTurns]:
    """Each continuation's {prompt id: turns}, checked against the hashes in lineage.json."""
    lineage = read_lineage(path)
    if lineage is None:
        return []
    d = lineage_dir(path)
    assert d is not None
    has = os.path.lexists(d / PROMPTS_FILE)
    lines = _prompt_lines(inside(d, PROMPTS_FILE, "lineage prompts")) if has else {}
    out = []
    for c in lineage["continuations"]:
        rec = (c.get("data") or {}).get("prompt_ids")
        got = lines.get(c["index"], {})
        if rec is None:
            out.append(got)
            continue
        if len(got) != rec["count"] or prompts_sha256(got) != rec["sha256"]:
            raise DFlashError(
                f"{d / PROMPTS_FILE}: continuation {c['index']}'s prompt ids do not match the "
                f"count and sha256 in {LINEAGE_FILE} (the files were edited or mixed up); "
                "restore both from the same export"
            )
        out.append(got)
    return out


def lineage_files(lineage: Lineage, prompts: list[PromptTurns]) -> dict[str, bytes]:
    """lineage.json and the prompt-id file, as bytes (the gzip is byte-for-byte repeatable)."""
    body = json.dumps(lineage, indent=1, sort_keys=False, default=str) + "\n"
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        for i, p in enumerate(prompts):
            row = {"index": i, "prompts": dict(sorted(p.items()))}
            gz.write((json.dumps(row, separators=(",", ":"), ensure_ascii=False) + "\n").encode())
    return {LINEAGE_FILE: body.encode("utf-8"), PROMPTS_FILE: buf.getvalue()}


def write_lineage(directory: str | Path, lineage: Lineage, prompts: list[PromptTurns]) -> None:
    """Both files, each written whole (atomic_dir.write_file_atomic), the prompt ids first:
    lineage.json holds their hash, so it is renamed into place last."""
    d = Path(directory)
    for name, data in sorted(lineage_files(lineage, prompts).items(), reverse=True):
        write_file_atomic(d / name, data)


# ------------------------------------------------------------------------- continuation


def append(
    parent: Lineage | None,
    parent_prompts: list[PromptTurns],
    continuation: dict[str, Any],
    prompts: PromptTurns | None,
) -> tuple[Lineage, list[PromptTurns]]:
    """The parent's lineage with `continuation` appended (index set, prompt ids hashed)."""
    lineage = json.loads(json.dumps(parent)) if parent else empty()
    conts = lineage["continuations"]
    c = {"index": len(conts), **continuation}
    data = dict(c.get("data") or {})
    data["prompt_ids"] = (
        None
        if prompts is None
        else {"count": len(prompts), "sha256": prompts_sha256(prompts), "file": PROMPTS_FILE}
    )
    c["data"] = data
    conts.append(c)
    if any(isinstance(v, list) for v in (prompts or {}).values()):
        lineage["version"] = max(int(lineage.get("version", 1)), TURN_LISTS)
    return lineage, [*parent_prompts, dict(prompts or {})]


def check_describes(lineage: Lineage, weights_hash: str, where: str) -> None:
    """Refuse a lineage whose last continuation did not produce (or export) these weights."""
    if not lineage["continuations"]:
        return
    last = lineage["continuations"][-1]
    known = {(last.get("result") or {}).get("weights_sha256")}
    known |= {e.get("weights_sha256") for e in last.get("exports") or []}
    if weights_hash not in known:
        raise DFlashError(
            f"{where}/{LINEAGE_FILE}: its last continuation describes other weights (sha256 "
            f"{sorted(k for k in known if k)}, these are {weights_hash}); the lineage does not "
            "belong to this drafter: remove it or copy the drafter files it came with"
        )


def recorded_turns(path: str | Path) -> RecordedTurns:
    """Every (prompt id, assistant turn) a continuation of the lineage at `path` trained on
    (hashes checked)."""
    if read_lineage(path) is None:
        raise DFlashError(
            f"--exclude-lineage {path}: no {LINEAGE_FILE} there (nor in {path}/drafter); give a "
            "drafter or run directory that records its lineage"
        )
    return RecordedTurns(read_prompts(path))


def recorded_ids(path: str | Path) -> set[str]:
    """Every prompt id a continuation of the lineage at `path` trained on (some turns of)."""
    return set(recorded_turns(path).by_id)


def totals(lineage: Lineage) -> dict[str, Any]:
    """Cumulative steps, documents, assistant turns, supervised tokens and per-source counts."""
    keys = ("documents", "assistant_turns", "supervised_tokens", "tokens")
    out: dict[str, Any] = {"continuations": len(lineage["continuations"]), "steps": 0}
    out |= {k: 0 for k in keys}
    sources: dict[str, dict[str, int]] = {}
    for c in lineage["continuations"]:
        out["steps"] += int(c.get("steps") or 0)
        data = c.get("data") or {}
        for k in keys:
            out[k] += int(data.get(k) or 0)
        for name, row in (data.get("sources") or {}).items():
            acc = sources.setdefault(name, {})
            for k, v in row.items():
                if isinstance(v, int):
                    acc[k] = acc.get(k, 0) + v
    out["sources"] = dict(sorted(sources.items()))
    return out
