"""Served numbers attached to a continuation: tau and speedup per prompt set and temperature.

Three report shapes are read, all written by this repository's tools:
- a `dflash eval` report (eval.json): `sets` at one temperature (`arguments.temperature`);
- a headline JSON (benchmarks/headline_report.py): `{set: {"t0": row, "t1": row}, "goals"}`;
- a side-by-side comparison (benchmarks/dflash2_vs_dflash.py): `{name: {set: {"t0": ...}}}`,
  of which `name` picks the drafter.
Each becomes `{set: {"t0": {tau, tau_pooled, speedup, responses, device}}}`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_trainer.errors import DFlashError
from dflash_trainer.lineage.record import now

ROW_KEYS = ("tau", "tau_pooled", "speedup", "responses", "device")


def _row(s: dict[str, Any], device: Any) -> dict[str, Any]:
    return {
        "tau": s.get("tau"),
        "tau_pooled": s.get("tau_pooled"),
        "speedup": s.get("speedup"),
        "responses": s.get("num_responses", s.get("responses")),
        "device": s.get("device", device),
    }


def _tkey(temperature: Any) -> str:
    return f"t{float(temperature or 0.0):g}"


def served_numbers(report: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """`{set: {tkey: row}}` of one report (see the module docstring for the shapes)."""
    if isinstance(report.get("sets"), dict):  # dflash eval
        env = report.get("environment") or {}
        device = env.get("gpu") or env.get("device")
        t = _tkey((report.get("arguments") or {}).get("temperature"))
        return {s: {t: _row(v, device)} for s, v in report["sets"].items()}
    if "goals" in report:  # headline JSON
        return {
            s: {t: _row(row, None) for t, row in v.items() if isinstance(row, dict)}
            for s, v in report.items()
            if isinstance(v, dict) and s != "goals"
        }
    if name is None or not isinstance(report.get(name), dict):
        names = sorted(k for k, v in report.items() if isinstance(v, dict) and k != "environment")
        raise DFlashError(
            f"not a `dflash eval` or headline report; as a side-by-side comparison it needs "
            f"--name, one of {names}"
        )
    env = report.get("environment") or {}
    device = env.get("gpu") or env.get("device")
    return {
        s: {t: _row(row, device) for t, row in temps.items()} for s, temps in report[name].items()
    }


def eval_entry(path: str | Path, name: str | None = None) -> dict[str, Any]:
    """What `dflash lineage add-eval` attaches: the report's path, date and served numbers."""
    p = Path(path)
    p = p / "eval.json" if p.is_dir() else p
    try:
        report = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"{path}: cannot read an evaluation report ({e})") from e
    if not isinstance(report, dict):
        raise DFlashError(f"{path}: an evaluation report is a JSON object")
    try:
        served = served_numbers(report, name)
    except DFlashError as e:
        raise DFlashError(f"{path}: {e}") from e
    if not served:
        raise DFlashError(f"{path}: holds no prompt set")
    return {"report": str(p), "name": name, "attached": now(), "served": served}


def merge_served(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """`{set: {tkey: row}}` over several attached evaluations, the latest one winning."""
    out: dict[str, Any] = {}
    for e in evals:
        for s, temps in (e.get("served") or {}).items():
            for t, row in temps.items():
                out.setdefault(s, {})[t] = row
    return out
