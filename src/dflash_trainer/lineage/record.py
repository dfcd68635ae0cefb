"""A drafter's lineage: every continuation that made its weights, in order.

A drafter directory (a run's `drafter/`, an export, a published drafter) may hold

    lineage.json               {"format": "dflash-lineage", "version": 1, "continuations": [...]}
    lineage_prompts.jsonl.gz   one line per continuation: {"index": i, "prompts": {id: turns}}

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
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.errors import DFlashError

LINEAGE_FILE = "lineage.json"
PROMPTS_FILE = "lineage_prompts.jsonl.gz"
LINEAGE_FILES = frozenset({LINEAGE_FILE, PROMPTS_FILE})
FORMAT = "dflash-lineage"
VERSION = 1

Lineage = dict[str, Any]
PromptTurns = dict[str, int | None]
"""Prompt id -> assistant turns trained on (None: not recorded, taken as all of them)."""


# ------------------------------------------------------------------------------- hashes


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def prompts_sha256(prompts: Mapping[str, int | None]) -> str:
    text = json.dumps(dict(sorted(prompts.items())), separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ------------------------------------------------------------------------- read / write


def empty() -> Lineage:
    return {"format": FORMAT, "version": VERSION, "continuations": []}


def lineage_dir(path: str | Path) -> Path | None:
    """The directory holding the lineage of the drafter at `path` (a drafter directory, or a
    run directory with a final `drafter/`); None when there is none."""
    p = Path(path)
    for d in (p, p / "drafter"):
        if (d / LINEAGE_FILE).is_file():
            return d
    return None


def read_lineage(path: str | Path) -> Lineage | None:
    """The lineage of the drafter at `path`, checked for its shape; None when it has none."""
    d = lineage_dir(path)
    if d is None:
        return None
    where = d / LINEAGE_FILE
    try:
        data = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"{where}: not readable as JSON ({e}); restore it from git") from e
    conts = data.get("continuations") if isinstance(data, dict) else None
    if data.get("format") != FORMAT or not isinstance(conts, list):
        raise DFlashError(f"{where}: not a dflash lineage (format {FORMAT!r} with continuations)")
    if data.get("version", 0) > VERSION:
        raise DFlashError(f"{where}: lineage version {data['version']} is newer than this tool")
    for i, c in enumerate(conts):
        if not isinstance(c, dict) or c.get("index") != i:
            raise DFlashError(f"{where}: continuation {i} is damaged or out of order")
    return dict(data)


def read_prompts(path: str | Path) -> list[PromptTurns]:
    """Each continuation's {prompt id: turns}, checked against the hashes in lineage.json."""
    lineage = read_lineage(path)
    if lineage is None:
        return []
    d = lineage_dir(path)
    assert d is not None
    lines: dict[int, PromptTurns] = {}
    if (d / PROMPTS_FILE).is_file():
        with gzip.open(d / PROMPTS_FILE, "rt", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                lines[int(row["index"])] = dict(row["prompts"])
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
    """Both files, each written to a temporary sibling and renamed into place."""
    d = Path(directory)
    for name, data in sorted(lineage_files(lineage, prompts).items(), reverse=True):
        tmp = d / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(d / name)


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


def recorded_ids(path: str | Path) -> set[str]:
    """Every prompt id a continuation of the lineage at `path` trained on (hashes checked)."""
    if read_lineage(path) is None:
        raise DFlashError(
            f"--exclude-lineage {path}: no {LINEAGE_FILE} there (nor in {path}/drafter); give a "
            "drafter or run directory that records its lineage"
        )
    return {pid for p in read_prompts(path) for pid in p}


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
