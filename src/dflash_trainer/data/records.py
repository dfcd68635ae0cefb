"""The normalised records every reader yields, and the report of what was kept or skipped.

A reader never raises on a bad record: it counts it under one reason and moves on, because
real inputs (the truncated ShareGPT dump, scraped chat logs) are dirty and a run must say how
dirty rather than die on record 9,312. Later stages (templating, length limits) can still reject
a record the reader kept; they do it through the same report so that, at the end,
`records == kept + sum(skipped.values())` holds for the whole pipeline.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")

SKIP_REASONS: dict[str, str] = {
    "bad_json": "the bytes do not decode as JSON (a damaged line or region, or a truncated tail)",
    "bad_schema": "valid JSON, but not a record of the chosen format (missing or mistyped field)",
    "unknown_role": "a turn has a role that is not system/user/assistant or a known alias",
    "non_text_content": "a turn's content has non-text parts (images, tool calls)",
    "empty_turn": "a turn's content is empty or whitespace only",
    "misplaced_system": "a system turn that is not the first turn",
    "not_alternating": "two user turns or two assistant turns in a row",
    "no_assistant_turn": "nothing to learn: no assistant turn after a user turn",
    "no_user_turn": "nothing to answer: no user turn (prompts for regeneration)",
    "duplicate": "the same conversation (same normalised content) was already kept",
    "bad_tokens": "pre-tokenized row with ids outside the tokenizer's vocabulary",
    "no_supervised_tokens": "pre-tokenized row whose loss_mask is all false",
    "special_token_in_content": "a turn contains the text of a chat-template control token",
    "template_error": "the chat template raised an error on this conversation",
    "mask_mismatch": "the assistant spans found in the render are inconsistent",
    "too_long": "more tokens than the max_tokens limit",
    "in_lineage": "the prompt id is recorded in the drafter's lineage (an earlier continuation "
    "trained on it)",
    "bad_utf8": "the text is not valid UTF-8 (invalid bytes or lone surrogate escapes)",
    "too_deep": "the JSON value is nested deeper than the decoder's recursion limit",
    "record_error": "reading the record raised an unexpected error (its type is listed under "
    "`errors`; please report it)",
}

REPAIRS: dict[str, str] = {
    "leading_assistant_dropped": "assistant turns before the first user turn were dropped "
    "(ShareGPT splits long chats; the prompt of that answer is in another record)",
    "trailing_user_dropped": "a final user turn without an answer was dropped (no supervision)",
    "duplicate_id_renamed": "a record id already used by a different conversation got a suffix",
    "boundary_token_merged": "the first token of an assistant turn also holds header characters",
}


class Skip(Exception):
    """A record is skipped; `reason` is a key of SKIP_REASONS (or of a reader's own reasons).

    `error`: the type of the unexpected exception behind a `record_error`, for the report.
    """

    def __init__(self, reason: str, error: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


@dataclass(frozen=True)
class Conversation:
    """A chat as a list of {role: system|user|assistant, content: str} messages."""

    id: str
    """The source's record id when it has one, else `<file>:<index>`; unique within a read."""
    messages: list[dict[str, str]]

    @property
    def content_hash(self) -> str:
        """sha1 of the normalised messages: stable across files, orders and runs."""
        return content_hash(self.messages)


@dataclass(frozen=True)
class TokenizedRow:
    """A pre-tokenized training row: already templated, so it bypasses the chat template."""

    id: str
    input_ids: list[int]
    loss_mask: list[bool]

    @property
    def content_hash(self) -> str:
        return content_hash({"input_ids": self.input_ids, "loss_mask": self.loss_mask})


Record = Conversation | TokenizedRow


def content_hash(obj: Any) -> str:
    # sort_keys and compact separators make the hash independent of how the source spelled it.
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha1(canonical.encode("utf-8")).hexdigest()


@dataclass
class ReadReport:
    """How many records were seen, kept, skipped (by reason) and repaired (by kind)."""

    source: str = ""
    records: int = 0
    kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    repairs: Counter[str] = field(default_factory=Counter)
    damaged_bytes: int = 0
    """Bytes of the input that could not be decoded (damaged regions and a truncated tail)."""
    errors: Counter[str] = field(default_factory=Counter)
    """Exception types behind `record_error` skips (none expected: each one is a bug to fix)."""

    def keep(self) -> None:
        self.records += 1
        self.kept += 1

    def skip(self, reason: str, error: str | None = None) -> None:
        assert reason in SKIP_REASONS, reason
        self.records += 1
        self.skipped[reason] += 1
        if error is not None:
            self.errors[error] += 1

    def reject(self, reason: str) -> None:
        """A later stage drops a record the reader kept."""
        assert reason in SKIP_REASONS, reason
        self.kept -= 1
        self.skipped[reason] += 1

    def repair(self, kind: str) -> None:
        assert kind in REPAIRS, kind
        self.repairs[kind] += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "records": self.records,
            "kept": self.kept,
            "skipped": dict(sorted(self.skipped.items())),
            "repairs": dict(sorted(self.repairs.items())),
            "damaged_bytes": self.damaged_bytes,
            "errors": dict(sorted(self.errors.items())),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReadReport:
        return cls(
            source=d["source"],
            records=d["records"],
            kept=d["kept"],
            skipped=Counter(d["skipped"]),
            repairs=Counter(d["repairs"]),
            damaged_bytes=d["damaged_bytes"],
            errors=Counter(d.get("errors", {})),  # absent in manifests of earlier versions
        )

    def format(self) -> str:
        lines = [f"read {self.source}: {self.records} records, {self.kept} kept"]
        for reason, n in sorted(self.skipped.items(), key=lambda kv: -kv[1]):
            lines.append(f"  skipped {n:>8}  {reason:<26} {SKIP_REASONS[reason]}")
        for kind, n in sorted(self.repairs.items(), key=lambda kv: -kv[1]):
            lines.append(f"  repaired {n:>7}  {kind:<26} {REPAIRS[kind]}")
        if self.damaged_bytes:
            lines.append(f"  {self.damaged_bytes} bytes could not be decoded")
        if self.errors:
            lines.append(f"  unexpected errors (record_error): {dict(self.errors)}")
        return "\n".join(lines)
