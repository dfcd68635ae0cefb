"""Served numbers attached to a continuation: tau and speedup per prompt set and temperature.

Three report shapes are read, all written by this repository's tools:
- a `dflash eval` report (eval.json): `sets` at one temperature (`arguments.temperature`);
- a headline JSON (benchmarks/headline_report.py): `{set: {"t0": row, "t1": row}, "goals"}`;
- a side-by-side comparison (benchmarks/dflash2_vs_dflash.py): `{name: {set: {"t0": ...}}}`,
  of which `name` picks the drafter.
Each becomes `{set: {"t0": {tau, tau_pooled, speedup, responses, device}}}`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_trainer.errors import DFlashError
from dflash_trainer.json_input import is_number, read_json
from dflash_trainer.lineage.record import now

ROW_KEYS = ("tau", "tau_pooled", "speedup", "responses", "device")


def _row(s: Any, device: Any, where: str) -> dict[str, Any]:
    """One set's served numbers at one temperature: finite numbers (or absent), a count."""
    if not isinstance(s, dict):
        raise DFlashError(f"{where} is not an object of served numbers")
    row = {k: s.get(k) for k in ("tau", "tau_pooled", "speedup")}
    for key, value in row.items():
        if value is not None and not is_number(value):
            raise DFlashError(f"{where}.{key} is {value!r:.40}, not a finite number")
    responses = s.get("num_responses", s.get("responses"))
    if responses is not None and (not is_number(responses) or responses < 0):
        raise DFlashError(f"{where}: responses is {responses!r:.40}, not a count")
    device = s.get("device", device)
    return {**row, "responses": responses, "device": None if device is None else str(device)}


def _tkey(temperature: Any) -> str:
    if temperature is not None and not is_number(temperature):
        raise DFlashError(f"arguments.temperature is {temperature!r:.40}, not a number")
    return f"t{float(temperature or 0.0):g}"


def _object_or_empty(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _objects(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DFlashError(f"{where} is not an object")
    return value


def served_numbers(report: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """`{set: {tkey: row}}` of one report (see the module docstring for the shapes)."""
    env = _object_or_empty(report.get("environment"))
    device = env.get("gpu") or env.get("device")
    if isinstance(report.get("sets"), dict):  # dflash eval
        args = _object_or_empty(report.get("arguments"))
        t = _tkey(args.get("temperature"))
        return {s: {t: _row(v, device, f"sets.{s}")} for s, v in report["sets"].items()}
    if "goals" in report:  # headline JSON
        return {
            s: {t: _row(row, None, f"{s}.{t}") for t, row in v.items() if isinstance(row, dict)}
            for s, v in report.items()
            if isinstance(v, dict) and s != "goals"
        }
    if name is None or not isinstance(report.get(name), dict):
        names = sorted(k for k, v in report.items() if isinstance(v, dict) and k != "environment")
        raise DFlashError(
            f"not a `dflash eval` or headline report; as a side-by-side comparison it needs "
            f"--name, one of {names[:20]}"
        )
    return {
        s: {t: _row(row, device, f"{name}.{s}.{t}") for t, row in _objects(temps, s).items()}
        for s, temps in report[name].items()
    }


def eval_entry(path: str | Path, name: str | None = None) -> dict[str, Any]:
    """What `dflash lineage add-eval` attaches: the report's path, date and served numbers.
    The report is a regular file (a FIFO is refused, not waited on) of a JSON object."""
    p = Path(path)
    p = p / "eval.json" if p.is_dir() else p
    report = read_json(p, "evaluation report")
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
        served = e.get("served")
        for s, temps in (served if isinstance(served, dict) else {}).items():
            # A hand-edited entry of another shape is not shown (read_lineage checks the rest).
            for t, row in (temps if isinstance(temps, dict) else {}).items():
                if isinstance(row, dict):
                    out.setdefault(s, {})[t] = row
    return out
