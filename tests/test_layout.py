"""The package's layout rules: no import cycles, the DFlash core imports no stage above it,
and code and documents point to nothing outside the repository.

Imports are read from the source with `ast` (lazy imports inside functions count too: a cycle
through a lazy import is still a cycle a reader has to untangle).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import dflash_trainer

ROOT = Path(dflash_trainer.__file__).parent
REPO = Path(__file__).resolve().parent.parent
# Modules every stage may use: the config tree, the error type, asset names, the version.
FOUNDATION = {
    "dflash_trainer",
    "dflash_trainer.config",
    "dflash_trainer.errors",
    "dflash_trainer.assets",
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (an imported name resolves to its module)."""
    mods = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                # A module importing its own package's __init__ is not an edge of the graph.
                if name and name != mod and not mod.startswith(name + "."):
                    deps.add(name)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_core_imports_no_stage_above_it():
    graph = import_graph()
    core = {m for m in graph if m.startswith("dflash_trainer.core")}
    assert core, "the core package moved: update this test"
    bad = {
        m: sorted(
            d for d in deps if not d.startswith("dflash_trainer.core") and d not in FOUNDATION
        )
        for m, deps in graph.items()
        if m in core
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_checks_can_fail(tmp_path):
    """A planted cycle and a planted upward import are found (the checks are not vacuous)."""
    pkg = tmp_path / "dflash_trainer"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from dflash_trainer.b import g\n")
    (pkg / "b.py").write_text("from dflash_trainer import a\n")
    (pkg / "core" / "m.py").write_text("from dflash_trainer.a import f\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [["dflash_trainer.a", "dflash_trainer.b"]]
    assert "dflash_trainer.a" in graph["dflash_trainer.core.m"]


# Documents a user of this repository does not have, and the story of how results were made
# (which run, which sitting) instead of what they are. Spelled in pieces so that this file
# does not match itself.
OUTSIDE = re.compile(
    "|".join(
        [
            "DFLASH" + "_SPEC",
            "ASSETS" + r"\.md",
            "(?i:design" + " repo)",
            "(?i:seed" + r"""(?: "?bug| runs?\b|'s\b))""",
            r"\((?i:seed): [A-Z]",
        ]
    )
)
STORY = re.compile(r"\b(?:" + "sess" + r"ions?|" + "sitt" + r"ings?|call \d)\b", re.IGNORECASE)


def _text_files() -> list[Path]:
    files = [
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(REPO / "benchmarks").rglob("*.md"),
    ]
    files += [p for p in (REPO / "src").rglob("*") if p.suffix in {".py", ".yaml"}]
    files += [p for p in (REPO / "benchmarks").rglob("*") if p.suffix in {".py", ".sh"}]
    files += [p for p in (REPO / "tests").rglob("*.py")]
    # Raw results and local benchmark output hold model answers, not the project's prose.
    raw = {("benchmarks", "results"), ("benchmarks", "out")}
    return [p for p in files if p.is_file() and p.relative_to(REPO).parts[:2] not in raw]


def outside_references(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) or (path.suffix == ".md" and STORY.search(line)):
                found.append(f"{path}:{n}: {line.strip()}")
    return found


def test_nothing_points_outside_the_repository():
    files = _text_files()
    assert len(files) > 50, "the repository layout moved: update this test"
    assert outside_references(files) == []


def test_the_reference_check_can_fail(tmp_path):
    planted = {
        "a.md": "see the " + "seed" + " run's hyperparameters\n",
        "b.py": "# copying it (" + "seed" + ' "Bug 1") is wrong\n',
        "c.md": "measured in " + "sess" + "ion 6\n",
    }
    for name, text in planted.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "ok.py").write_text("torch.manual_seed(seed)  # a seed: int of the run\n")
    found = outside_references(sorted(tmp_path.iterdir()))
    assert [f.split(":")[0].rsplit("/", 1)[1] for f in found] == ["a.md", "b.py", "c.md"]
