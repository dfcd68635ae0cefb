"""The output file of `dflash data regenerate`: appending records, reading them back to resume,
and compacting the file when a conversation was continued.

One record per conversation, appended with one write and fsynced (append_log.py), so a
crash leaves at most one partial last line (dropped when the file is read back). A record whose conversation still
has user turns it did not answer (kept at an interrupt or at the time limit, `open` true) is
continued by the next job, which appends the longer record; the last record of an id is the
one that counts. Continued records are compacted away at the end of that job (and, after a
crash, at the start of the next): the file is rewritten to a temporary name, fsynced and
renamed over the original, so every reader sees one record per conversation and no state of
the file ever lacks an answered turn.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_trainer.atomic_dir import fsync_path, staged_file
from dflash_trainer.data.append_log import append_line, complete_lines
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.settings import GenerationSettings
from dflash_trainer.errors import DFlashError

SETTINGS_THAT_MUST_MATCH = ("model", "temperature", "top_p", "max_new_tokens", "enable_thinking")


@dataclass
class OutputIndex:
    """What a job needs of the output it resumes: each id's last record, where it lies."""

    path: Path
    answered: dict[str, int] = field(default_factory=dict)
    """Id -> assistant turns in its last record."""
    offsets: dict[str, int] = field(default_factory=dict)
    """Id -> byte offset of its last record."""
    closed: set[str] = field(default_factory=set)
    """Ids whose last record says it is finished (`open` false): never continued."""
    duplicates: int = 0
    """Records superseded by a later record of the same id (compact() removes them)."""

    def __contains__(self, rid: object) -> bool:
        return rid in self.answered

    def __len__(self) -> int:
        return len(self.answered)

    def record(self, rid: str) -> dict[str, Any]:
        with open(self.path, "rb") as f:
            f.seek(self.offsets[rid])
            return dict(json.loads(f.readline()))


def _parse(line: bytes, path: Path, lineno: int) -> tuple[str, dict[str, Any]]:
    try:  # not JSON, not UTF-8, too deep, or not one of our records: not our file
        rec = json.loads(line)
        gen, rid = rec["generation"], rec["id"]
        if not isinstance(gen, dict) or not isinstance(rid, str):
            raise TypeError("`generation` is not an object or `id` is not a string")
    except (ValueError, RecursionError, KeyError, TypeError) as e:
        raise DFlashError(
            f"{path}: line {lineno} is not a regeneration record ({e}); the file was "
            "edited or written by something else: move it aside or pass another --out"
        ) from e
    return rid, gen


def read_output(out_path: Path, settings: GenerationSettings) -> OutputIndex:
    """Index the output; drops a partial last line; refuses other settings."""
    index = OutputIndex(out_path)
    if not out_path.exists():
        return index
    for lineno, offset, line in complete_lines(out_path):
        if not line.strip():
            continue
        rid, gen = _parse(line, out_path, lineno)
        for key in SETTINGS_THAT_MUST_MATCH:
            if gen.get(key) != getattr(settings, key):
                raise DFlashError(
                    f"{out_path} was generated with {key}={gen.get(key)!r}, this job uses "
                    f"{key}={getattr(settings, key)!r}; resume with the same settings or "
                    "write to another --out"
                )
        index.duplicates += rid in index.answered
        reasons = gen.get("finish_reasons")
        index.answered[rid] = len(reasons) if isinstance(reasons, list) else 0
        index.offsets[rid] = offset
        # Records written before `open` was recorded have no key: they may be continued.
        (index.closed.add if gen.get("open") is False else index.closed.discard)(rid)
    return index


def read_done(out_path: Path, settings: GenerationSettings) -> set[str]:
    """Ids already in the output (read_output's index, as a set)."""
    return set(read_output(out_path, settings).answered)


def compact(out_path: Path) -> int:
    """Rewrite `out_path` keeping only the last record of every id; records removed.

    Why atomic: the file is the job's only copy of its answers; the rewrite goes to a
    temporary file that replaces the original only once it is complete and on disk."""
    last: dict[str, int] = {}
    with open(out_path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                last[_parse(line, out_path, lineno)[0]] = lineno
    keep = set(last.values())
    removed = 0
    with staged_file(out_path) as tmp:
        with open(out_path, "rb") as src, open(tmp, "wb") as dst:
            for lineno, line in enumerate(src, 1):
                if lineno in keep:
                    dst.write(line)
                elif line.strip():
                    removed += 1
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out_path)
    fsync_path(out_path.parent)
    return removed


def plan_resume(
    conversations: Iterable[Conversation], index: OutputIndex, max_turns: int | None
) -> tuple[list[Conversation], dict[str, dict[str, Any]], int, int]:
    """(the conversations still to answer, each id once; the earlier records of those left
    open, continued from their answered turns; how many are done; how many continue)."""
    pending: list[Conversation] = []
    resume: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    done = continued = 0
    for c in conversations:
        if c.id in seen:  # an id given twice in one job is answered once
            done += 1
            continue
        seen.add(c.id)
        users = sum(m["role"] == "user" for m in c.messages)
        users = min(users, max_turns) if max_turns else users
        if c.id in index:
            if c.id not in index.closed and index.answered[c.id] < users:
                rec = index.record(c.id)
                if _continues(rec, c):
                    resume[c.id] = rec
                    pending.append(c)
                    continued += 1
                    continue
            done += 1
        elif users:
            pending.append(c)
    return pending, resume, done, continued


def _continues(rec: dict[str, Any], conv: Conversation) -> bool:
    """Whether `rec` answered the first turns of `conv` as it is now (same system turn and
    user turns): only then are its answers the history of the turns still to answer."""
    msgs, gen = rec.get("messages"), rec.get("generation", {})
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        return False
    reasons, counts = gen.get("finish_reasons"), gen.get("completion_tokens")
    if not isinstance(reasons, list) or not isinstance(counts, list) or len(reasons) != len(counts):
        return False

    def turns(ms: list[dict[str, Any]], role: str) -> list[Any]:
        return [m.get("content") for m in ms if m.get("role") == role]

    head = [(m["role"], m["content"]) for m in conv.messages[:1] if m["role"] == "system"]
    rec_head = [(m.get("role"), m.get("content")) for m in msgs[:1] if m.get("role") == "system"]
    asked = turns(msgs, "user")
    return (
        rec_head == head
        and asked == turns(conv.messages, "user")[: len(asked)]
        and len(turns(msgs, "assistant")) == len(asked) == len(reasons)
    )


class Writer:
    """Appends records, one write each, flushed and fsynced."""

    def __init__(self, path: Path, settings: GenerationSettings) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by the job)
        self.settings = asdict(settings)

    def write(
        self,
        rid: str,
        messages: list[dict[str, str]],
        finish_reasons: list[str],
        completion_tokens: list[int],
        open_turns: bool,
    ) -> None:
        gen = {
            **self.settings,
            "finish_reasons": finish_reasons,
            "completion_tokens": completion_tokens,
            "open": open_turns,
        }
        append_line(self.f, json.dumps({"id": rid, "messages": messages, "generation": gen}))
