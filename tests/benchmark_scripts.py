"""Load a script of benchmarks/ as a module, for the tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def load_benchmark(name: str, monkeypatch: Any = None) -> ModuleType:
    """benchmarks/<name>.py as a module named `name`. With `monkeypatch`, it is also in
    sys.modules while the test runs (a dataclass of the script looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod
