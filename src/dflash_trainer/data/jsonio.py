"""Raw values out of damaged files: JSON arrays, JSON Lines, YAML, gzip, and HF dataset rows.

A `.json` array is decoded element by element with `json.JSONDecoder.raw_decode`, not with
`json.load`: one damaged element (or a truncated tail, as in the ShareGPT asset) would otherwise
lose the whole file. After a damaged element the decoder resynchronises on the next `{` that
decodes to something that looks like a record (a dict with a record key such as `conversations`),
so the inner objects of a damaged record (its turns) are not mistaken for records. One damaged
region counts as one `bad_json` record: how many records it held cannot be known.

The whole `.json` file is read into memory (a 125 MB file is fine); JSON Lines stream. What a
failure means (a counted skip, or an error naming the file) is decided in `guard`.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trainer.data.guard import BadValue, check_bom, decode_json, guard_file, nbytes
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import open_input, read_input_bytes

RECORD_KEYS = frozenset(
    {"conversations", "messages", "input_ids", "prompt", "text", "question", "instruction", "turns"}
)
JSON_SUFFIXES = (".json", ".json.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson")
YAML_SUFFIXES = (".yml", ".yaml")
SUFFIXES = JSON_SUFFIXES + JSONL_SUFFIXES + YAML_SUFFIXES

_SKIP_WS_COMMAS = re.compile(r"[\s,]*")
_SKIP_WS = re.compile(r"\s*")


def looks_like_record(value: Any) -> bool:
    return isinstance(value, dict) and not RECORD_KEYS.isdisjoint(value)


def _open_text(path: Path) -> io.TextIOWrapper:
    """Text of a (gzipped) file. surrogateescape: an invalid UTF-8 byte damages only the record
    holding it (`bad_utf8`), it is not silently replaced; a UTF-8 byte-order mark is skipped."""
    raw: Any = open_input(path)
    try:
        skip = check_bom(raw.read(4), path)
        raw.seek(skip)
    except BaseException:
        raw.close()
        raise
    return io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape")


def _resync(text: str, start: int, decoder: json.JSONDecoder) -> tuple[int, Any] | None:
    """Position and value of the next element after a damaged one, or None if there is none."""
    pos = text.find("{", start)
    while pos != -1:
        try:
            value, end = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # damaged, too long a number, too deep
            pos = text.find("{", pos + 1)
            continue
        if looks_like_record(value):
            return pos, value
        # A complete inner object (a turn): no record can start inside it.
        pos = text.find("{", end)
    return None


def iter_json_text(text: str) -> Iterator[Any]:
    """Values of a JSON array (or of concatenated top-level values), surviving damage."""
    decoder = json.JSONDecoder()
    i = _SKIP_WS.match(text, 0).end()  # type: ignore[union-attr]
    in_array = text.startswith("[", i)
    if in_array:
        i += 1
    n = len(text)
    while True:
        i = _SKIP_WS_COMMAS.match(text, i).end()  # type: ignore[union-attr]
        if i >= n:
            return
        if in_array and text[i] == "]":
            tail = text[i + 1 :].strip()
            if tail:
                yield BadValue(nbytes(tail))
            return
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError) as e:
            found = _resync(text, i + 1, decoder)
            stop = found[0] if found is not None else n
            reason = "too_deep" if isinstance(e, RecursionError) else "bad_json"
            yield BadValue(nbytes(text[i:stop]), reason)
            if found is None:
                return
            i = found[0]
            continue
        yield value


def iter_jsonl(path: Path) -> Iterator[Any]:
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                yield decode_json(line)


def iter_yaml(path: Path) -> Iterator[Any]:
    """ChatterBot corpus files: `conversations: [[user, bot, user, ...], ...]`.

    The file is one value: if it does not decode (or is not UTF-8) it counts as one bad record.
    """
    import yaml

    from dflash_trainer.yaml_input import strict_load

    data = read_input_bytes(path)
    try:
        doc = strict_load(data[check_bom(data[:4], path) :].decode("utf-8"))
    except UnicodeDecodeError:
        yield BadValue(len(data), "bad_utf8")
        return
    except RecursionError:
        yield BadValue(len(data), "too_deep")
        return
    except (yaml.YAMLError, ValueError, OverflowError):  # syntax, or a value like 2001-02-30
        yield BadValue(len(data))
        return
    convs = doc.get("conversations") if isinstance(doc, dict) else None
    if not isinstance(convs, list):
        yield BadValue(len(data))
        return
    yield from convs


def input_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
        if not files:
            raise DFlashError(f"{path} holds no {'/'.join(SUFFIXES)} files")
        return files
    if not path.name.endswith(SUFFIXES):
        raise DFlashError(
            f"{path}: unknown file type; use one of {', '.join(SUFFIXES)} "
            "(JSON arrays, JSON Lines, ChatterBot YAML)"
        )
    return [path]


def iter_file_values(path: Path) -> Iterator[Any]:
    if path.name.endswith(JSONL_SUFFIXES):
        yield from iter_jsonl(path)
    elif path.name.endswith(YAML_SUFFIXES):
        yield from iter_yaml(path)
    else:
        with _open_text(path) as f:
            text = f.read()
        yield from iter_json_text(text)


@dataclass(frozen=True)
class HFDataset:
    """A Hugging Face dataset, `name` or `name:split`."""

    name: str


def require_datasets(name: str) -> None:
    if importlib.util.find_spec("datasets") is None:
        raise DFlashError(
            f"{name!r} is not a local file, so it was taken as a Hugging Face dataset name, "
            "which needs the `datasets` package: pip install datasets "
            "(or pass a local .json/.jsonl path or asset:<name>)"
        )


def iter_hf_dataset(name: str) -> Iterator[Any]:
    """Rows of a Hugging Face dataset, `name` or `name:split` (streamed, nothing cached whole)."""
    require_datasets(name)
    import datasets

    repo, _, split = name.partition(":")
    yield from datasets.load_dataset(repo, split=split or "train", streaming=True)


def iter_source_values(source: Path | HFDataset) -> Iterator[tuple[str, Any]]:
    """(record name, value) for every value of the source, `BadValue` for undecodable ones."""
    if isinstance(source, HFDataset):
        for i, row in enumerate(iter_hf_dataset(source.name)):
            yield f"{source.name}:{i}", row
        return
    for path in input_files(source):
        for i, value in enumerate(guard_file(path, iter_file_values(path))):
            yield f"{path.name}:{i}", value
