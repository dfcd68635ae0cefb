"""Per-slot acceptance of every drafter in a dflash2_vs_dflash.json, one panel per prompt set
and temperature: where along the block each kind loses its drafts.

    python benchmarks/dflash2_vs_dflash_plot.py benchmarks/results/dflash2_vs_dflash_smollm2.json \
        --out benchmarks/results/dflash2_vs_dflash_smollm2_h100_202612/per_slot.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def _curves(summary: dict[str, Any]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """(set, temperature) -> drafter name -> per-slot acceptance (slots never reached cut;
    the deep slots are reached by few steps, so their values are noisy)."""
    panels: dict[tuple[str, str], dict[str, list[float]]] = {}
    for name, sets in summary.items():
        if name in ("environment", "not_measured", "training_steps") or not isinstance(sets, dict):
            continue
        for set_name, temps in sets.items():
            for tkey, res in temps.items():
                acc = [a for a in res.get("per_position_acceptance") or [] if a is not None]
                acc = [a for a in acc if isinstance(a, float | int) and math.isfinite(a)]
                if acc:
                    panels.setdefault((set_name, tkey), {})[name] = acc
    return panels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", help="a dflash2_vs_dflash.json")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    panels = _curves(json.loads(Path(args.summary).read_text()))
    if not panels:
        raise SystemExit(f"{args.summary}: no per-slot acceptance in it")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(panels, key=lambda k: (k[1], k[0]))
    cols = len({k[0] for k in keys})
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        for name, acc in sorted(panels[key].items()):
            ax.plot(range(1, len(acc) + 1), acc, marker=".", label=name)
        ax.set_title(f"{key[0]}, {key[1]}")
        ax.set_xlabel("slot in the block")
        ax.set_ylabel("P(accepted | reached)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)  # each panel its own: t>0 panels carry drafters t=0 lacks
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
