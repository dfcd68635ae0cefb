"""Append-only JSON Lines outputs (regeneration, synthesis): one write per record, and
reading them back to resume.

Why one write, flushed and fsynced: a job killed at any moment leaves at most one partial
last line, which the next job's read drops before it appends. Only a tail that begins like a
record of ours (`RECORD_START`) is dropped: a file that merely lacks its last newline is another
program's (a `--out` naming the wrong file), and cutting it would destroy it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from dflash_trainer.errors import DFlashError

RECORD_START = b'{"id": '
"""How every record line of these outputs begins (json.dumps of a dict whose first key is id)."""


def complete_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line) of every complete line of `path`; once all were
    read, a partial last line (a job killed mid-write) is cut off the file. A reader that
    stops early (a line it refuses) leaves the file as it was."""
    good_end = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break
            yield lineno, good_end, line
            good_end += len(line)
    size = path.stat().st_size
    if good_end < size:
        with open(path, "r+b") as f:
            f.seek(good_end)
            tail = f.read(len(RECORD_START))
            if not RECORD_START.startswith(tail) and not tail.startswith(RECORD_START):
                raise DFlashError(
                    f"{path}: its last line ({size - good_end:,} bytes without a newline) is "
                    "not a record this tool writes, so the file is not one of its outputs; "
                    "nothing was changed: move it aside or give another --out"
                )
            f.truncate(good_end)


def append_line(f: IO[str], text: str) -> None:
    """Append one record's line with one write, then flush and fsync it."""
    f.write(text + "\n")
    f.flush()
    os.fsync(f.fileno())
