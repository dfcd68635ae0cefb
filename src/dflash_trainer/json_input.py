"""JSON files the tool reads back (run directories, checkpoints, lineages, reports): every
failure is a `DFlashError` naming the file, never a traceback or a hang.

`read_json` opens only a regular file of bounded size (input_files.read_small_text: a FIFO
or a device is refused before any read), and `parse_json` refuses what `json.loads` would
turn into a crash later: a value nested deeper than `MAX_DEPTH` (a file of a million `[`
is a RecursionError in the parser, and a value a few hundred deep is one in the first
`json.dumps(..., indent=...)` or recursive walk that meets it; no file of this tool nests
more than a dozen levels), and with `kind` a value of another type than the caller reads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import SMALL_FILE_BYTES, read_small_text

MAX_DEPTH = 64


def _too_deep(value: Any, limit: int) -> bool:
    """Whether containers nest deeper than `limit` (an explicit stack: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if not isinstance(v, dict | list):
            continue
        if depth > limit:
            return True
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def parse_json(text: str | bytes, where: str, kind: type | None = None) -> Any:
    """`json.loads(text)`, or a DFlashError `where: ...` (not JSON, nested too deep, or
    not of type `kind`)."""
    try:
        value = json.loads(text)
    except RecursionError:
        value, deep = None, True
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError of bytes
        raise DFlashError(f"{where}: not valid JSON ({_short(e)})") from None
    else:
        deep = _too_deep(value, MAX_DEPTH)
    if deep:
        raise DFlashError(
            f"{where}: JSON nested more than {MAX_DEPTH} levels deep; no file of this kind "
            "is (damaged or not the file meant)"
        )
    if kind is not None and not isinstance(value, kind):
        raise DFlashError(
            f"{where}: a JSON {_json_type(value)}, not a JSON {_json_type(kind())} as expected"
        )
    return value


def read_json(
    path: str | Path, what: str, kind: type | None = dict, max_bytes: int = SMALL_FILE_BYTES
) -> Any:
    """The JSON value of the regular file `path` (see the module docstring); by default a
    JSON object. `what` names the file in errors ("checkpoint meta")."""
    p = Path(path)
    return parse_json(read_small_text(p, what, max_bytes), f"{what} {p}", kind)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool: what a metric or a measured number must be."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _short(e: Exception, limit: int = 120) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
