"""One lineage job's verdict: the new drafter against the one it continued, served side by side.

Reads the comparison of benchmarks/dflash2_vs_dflash.py (drafters named `new` and `published`,
one target-only baseline per set and temperature) and the new drafter's lineage, and writes

    OUT/job.json                 both drafters' rows, their mean t=0 tau, `better` (the new one's
                                 mean t=0 tau over the sets is higher) and the new continuation
    OUT/headline_smollm2.json    the new drafter's numbers in benchmarks/headline_report.py's
                                 shape ({set: {"t0", "t1"}}, "drafter", "goals"), plus "lineage"

    python benchmarks/headline_job_report.py --eval OUT/eval/dflash2_vs_dflash.json \\
        --drafter OUT/export --out OUT [--t1 EVAL_DIR ...]

`--t1` adds the new drafter's t=1 rows from `dflash eval` reports measured apart (a job whose
device time ended before its t=1 pass), for the sets the comparison has no t=1 of.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from headline_report import GOALS, _row, _where

from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.card import read_eval_report
from dflash_trainer.input_files import read_small_text
from dflash_trainer.lineage.record import read_lineage, totals


def rows(summary: dict[str, Any], name: str, device: Any) -> dict[str, Any]:
    """{set: {tkey: row}} in the headline JSON's row shape."""
    out: dict[str, Any] = {}
    for set_name, temps in (summary.get(name) or {}).items():
        for t, e in temps.items():
            out.setdefault(set_name, {})[t] = {
                "device": device,
                "tau": e.get("tau"),
                "tau_pooled": e.get("tau_pooled"),
                "speedup": e.get("speedup"),
                "responses": e.get("num_responses"),
                "decode_tokens_per_s": e.get("decode_tokens_per_s"),
                "lossless_mismatches": e.get("lossless_mismatches"),
                "per_position_acceptance": e.get("per_position_acceptance"),
                "decode": e.get("decode"),
            }
    return out


def mean_t0(r: dict[str, Any]) -> float | None:
    taus = [v["t0"]["tau"] for v in r.values() if isinstance((v.get("t0") or {}).get("tau"), float)]
    return sum(taus) / len(taus) if taus else None


def goals(r: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for (name, temp, metric), need in GOALS.items():
        got = (r.get(name) or {}).get(temp, {}).get(metric)
        out[f"{name} {temp} {metric} >= {need}"] = {
            "measured": got,
            "met": got is not None and got >= need,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--eval", type=Path, required=True, help="dflash2_vs_dflash.json")
    ap.add_argument("--drafter", required=True, help="the new drafter (with lineage.json)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--t1",
        type=Path,
        nargs="+",
        default=[],
        help="`dflash eval` reports (dirs or eval.json) of the new drafter at t=1, measured "
        "apart (on CPU when the job's device time ended): rows for the sets the comparison "
        "has no t=1 of, each with its own device",
    )
    args = ap.parse_args(argv)
    try:  # a regular file of bounded size: a FIFO named here would block the report
        summary = json.loads(read_small_text(args.eval, "comparison summary"))
    except (DFlashError, ValueError) as e:
        raise SystemExit(f"--eval {args.eval}: {e}") from e
    if not isinstance(summary, dict):
        raise SystemExit(f"--eval {args.eval}: not a comparison summary (a JSON object)")
    env = summary.get("environment") or {}
    device = env.get("gpu") or env.get("device")
    new, old = rows(summary, "new", device), rows(summary, "published", device)
    for path in args.t1:
        try:  # regular files only, size-bounded, checked for its sets
            report = read_eval_report(path, "--t1")
        except DFlashError as e:
            raise SystemExit(str(e)) from e
        for name, result in report["sets"].items():
            new.setdefault(name, {}).setdefault("t1", _row(result, _where(report)))
    lineage = read_lineage(args.drafter)
    if lineage is None:
        raise SystemExit(f"{args.drafter}: no lineage.json")
    last = lineage["continuations"][-1]
    m_new, m_old = mean_t0(new), mean_t0(old)
    better = m_new is not None and m_old is not None and m_new > m_old
    job = {
        "drafter": args.drafter,
        "continuation": {k: v for k, v in last.items() if k not in ("config", "evals")},
        "lineage_totals": totals(lineage),
        "new": new,
        "published": old,
        "mean_t0_tau": {"new": m_new, "published": m_old},
        "better": better,
        "decision": "publish the new drafter" if better else "keep the published drafter",
        "environment": env,
    }
    headline = {
        **new,
        "drafter": args.drafter,
        "goals": goals(new),
        "lineage": {"totals": totals(lineage), "continuation": last["index"]},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name, obj in (("job.json", job), ("headline_smollm2.json", headline)):
        tmp = args.out / f".{name}.tmp"
        tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
        tmp.replace(args.out / name)
    print(f"mean t=0 tau: new {m_new}, published {m_old}: {job['decision']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
