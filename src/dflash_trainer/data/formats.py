"""Records of every supported format, normalised to `Conversation` or `TokenizedRow`.

Formats (`fmt="auto"` picks one per record from its keys, so a mixed file also reads):
- sharegpt:  {"id", "conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}]}
- openai:    {"id", "messages": [{"role": "user"|"assistant"|"system", "content": str | parts}]}
- prompts:   {"prompt"|"text"|"question"|"instruction": str}, {"turns": [str, ...]} (MT-Bench:
             one user turn each, answered in order by regeneration) or a bare JSON string
- tokenized: {"input_ids": [int], "loss_mask": [0|1|bool]} (already templated)
- chatterbot: a YAML list of strings, alternating user / assistant

A conversation is checked in a fixed order and the first failing check names the skip reason:
schema (every turn), roles (every turn), empty turns (every turn), then structure (a system
turn only first; leading assistant turns dropped; strict user/assistant alternation), then the
presence of an assistant turn (or of a user turn, for regeneration), then the text (a lone
surrogate is `bad_utf8`), then duplicates. Each record is read through `guard.guard_record`,
so whatever it raises is a counted skip, never the end of the read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_trainer.data.guard import BadValue, guard_record
from dflash_trainer.data.jsonio import HFDataset, iter_source_values
from dflash_trainer.data.loading import resolve_source
from dflash_trainer.data.records import Conversation, ReadReport, Record, Skip, TokenizedRow

FORMATS = ("auto", "sharegpt", "openai", "prompts", "tokenized", "chatterbot")

ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
PROMPT_KEYS = ("prompt", "text", "question", "instruction")


def detect_format(value: Any) -> str | None:
    if isinstance(value, dict):
        if "conversations" in value:
            return "sharegpt"
        if "messages" in value:
            return "openai"
        if "input_ids" in value:
            return "tokenized"
        if "turns" in value or any(k in value for k in PROMPT_KEYS):
            return "prompts"
        return None
    if isinstance(value, str):
        return "prompts"
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return "chatterbot"
    return None


def _text_of(content: Any) -> str:
    """OpenAI content: a string, or a list of parts of which only text parts are accepted."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise Skip("non_text_content")
            if not isinstance(part.get("text"), str):
                raise Skip("bad_schema")
            texts.append(part["text"])
        return "".join(texts)
    raise Skip("bad_schema")


def _raw_turns(value: Any, fmt: str) -> list[tuple[Any, str]]:
    """(raw role, content) pairs, checking only the schema."""
    if fmt == "chatterbot":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise Skip("bad_schema")
        return [("user" if i % 2 == 0 else "assistant", v) for i, v in enumerate(value)]
    key, role_key, content_key = (
        ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
    )
    turns = value.get(key) if isinstance(value, dict) else None
    if not isinstance(turns, list):
        raise Skip("bad_schema")
    pairs: list[tuple[Any, str]] = []
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get(role_key), str):
            raise Skip("bad_schema")
        # ShareGPT values must be strings; OpenAI content may also be a list of text parts.
        content = _text_of(t.get(content_key)) if fmt == "openai" else t.get(content_key)
        if not isinstance(content, str):
            raise Skip("bad_schema")
        pairs.append((t[role_key], content))
    return pairs


def _structure(
    messages: list[dict[str, str]], require_assistant: bool, repairs: list[str]
) -> list[dict[str, str]]:
    if any(m["role"] == "system" for m in messages[1:]):
        raise Skip("misplaced_system")
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(head) :]
    lead = 0
    while lead < len(body) and body[lead]["role"] == "assistant":
        lead += 1
    if lead:
        repairs.append("leading_assistant_dropped")
        body = body[lead:]
    expected = ("user", "assistant")
    if any(m["role"] != expected[i % 2] for i, m in enumerate(body)):
        raise Skip("not_alternating")
    if require_assistant:
        if len(body) > 1 and body[-1]["role"] == "user":
            repairs.append("trailing_user_dropped")
            body = body[:-1]
        if not any(m["role"] == "assistant" for m in body):
            raise Skip("no_assistant_turn")
    elif not body:
        raise Skip("no_user_turn")
    return head + body


def normalise_conversation(
    value: Any, fmt: str, require_assistant: bool, repairs: list[str]
) -> list[dict[str, str]]:
    pairs = _raw_turns(value, fmt)
    roles = [ROLE_ALIASES.get(r.lower()) if isinstance(r, str) else None for r, _ in pairs]
    if any(r is None for r in roles):
        raise Skip("unknown_role")
    if any(not c.strip() for _, c in pairs):
        raise Skip("empty_turn")
    messages = [{"role": r, "content": c} for r, (_, c) in zip(roles, pairs) if r is not None]
    return _structure(messages, require_assistant, repairs)


def normalise_prompts(value: Any, require_assistant: bool) -> list[dict[str, str]]:
    if isinstance(value, str):
        turns: Any = [value]
    elif "turns" in value:
        turns = value["turns"]
    else:
        turns = [next(value[k] for k in PROMPT_KEYS if k in value)]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise Skip("bad_schema")
    if any(not t.strip() for t in turns):
        raise Skip("empty_turn")
    if require_assistant:
        raise Skip("no_assistant_turn")
    # Consecutive user turns are the point here: regeneration answers each one in order.
    return [{"role": "user", "content": t} for t in turns]


def normalise_tokenized(value: Any) -> tuple[list[int], list[bool]]:
    if not isinstance(value, dict):
        raise Skip("bad_schema")
    ids, mask = value.get("input_ids"), value.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask) or not ids:
        raise Skip("bad_schema")
    if not all(type(t) is int for t in ids) or not all(m in (0, 1) for m in mask):
        raise Skip("bad_schema")
    if not all(0 <= t < 2**31 for t in ids):  # outside every vocabulary (and int32)
        raise Skip("bad_tokens")
    if not any(mask):
        raise Skip("no_supervised_tokens")
    return ids, [bool(m) for m in mask]


def _record_id(value: Any, name: str) -> str:
    """The source's own id (ShareGPT `id`, MT-Bench `question_id`, HumanEval `task_id`)."""
    if isinstance(value, dict):
        for key in ("id", "question_id", "task_id"):
            rid = value.get(key)
            if isinstance(rid, str | int) and not isinstance(rid, bool):
                return str(rid)
    return name


def checked(record: Record, repairs: list[str]) -> tuple[Record, list[str], str]:
    """(record, repairs, content hash); text that cannot be written as UTF-8 (a lone
    surrogate, in the content or the id) raises UnicodeEncodeError, which guard counts."""
    record.id.encode("utf-8")
    return record, repairs, record.content_hash


def normalise(value: Any, fmt: str, require_assistant: bool, name: str) -> tuple[Record, list[str]]:
    """One raw value -> (record, repairs made), or raise Skip."""
    detected = detect_format(value) if fmt == "auto" else fmt
    record_id = _record_id(value, name)
    repairs: list[str] = []
    if detected is None:
        raise Skip("bad_schema")
    if detected == "tokenized":
        ids, mask = normalise_tokenized(value)
        return TokenizedRow(id=record_id, input_ids=ids, loss_mask=mask), repairs
    if detected == "prompts":
        if not isinstance(value, str | dict):
            raise Skip("bad_schema")
        messages = normalise_prompts(value, require_assistant)
    else:
        messages = normalise_conversation(value, detected, require_assistant, repairs)
    return Conversation(id=record_id, messages=messages), repairs


def _renamed(record: Record, new_id: str) -> Record:
    if isinstance(record, Conversation):
        return Conversation(id=new_id, messages=record.messages)
    return TokenizedRow(id=new_id, input_ids=record.input_ids, loss_mask=record.loss_mask)


def read_records(
    source: str | Path | HFDataset,
    fmt: str = "auto",
    report: ReadReport | None = None,
    require_assistant: bool = True,
    max_records: int | None = None,
) -> Iterator[Record]:
    """Normalised records of a file, a folder of files, `asset:<name>` or an HF dataset.

    `report` receives every count; `max_records` bounds the records read (kept or skipped,
    damaged regions included). `require_assistant=False` reads prompts for regeneration (the
    assistant turns, if any, are replaced later, so a conversation only needs a user turn).
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    report = report if report is not None else ReadReport(source=str(source))
    resolved = resolve_source(source)
    seen_hashes: set[str] = set()
    seen_ids: dict[str, int] = {}
    for name, value in iter_source_values(resolved):
        if max_records is not None and report.records >= max_records:
            return
        if isinstance(value, BadValue):
            report.skip(value.reason)
            report.damaged_bytes += value.nbytes
            continue
        outcome = guard_record(
            lambda: checked(*normalise(value, fmt, require_assistant, name))  # noqa: B023
        )
        if isinstance(outcome, Skip):
            report.skip(outcome.reason, outcome.error)
            continue
        record, repairs, h = outcome
        if h in seen_hashes:
            report.skip("duplicate")
            continue
        seen_hashes.add(h)
        if record.id in seen_ids:
            # Same id, different content (ShareGPT has 123 of these): keep both, renamed stably.
            seen_ids[record.id] += 1
            record = _renamed(record, f"{record.id}~{seen_ids[record.id]}")
            repairs.append("duplicate_id_renamed")
        seen_ids.setdefault(record.id, 1)
        for kind in repairs:
            report.repair(kind)
        report.keep()
        yield record
