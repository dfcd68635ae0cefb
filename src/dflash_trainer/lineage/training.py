"""The trainer's side of the lineage: what a run inherits, what it refuses, what it appends.

`Inheritance.of` reads the start drafter's lineage (checked against the weights that were
loaded), `check_fresh` refuses training data that supervises an assistant turn of a prompt
the lineage already trained on (later turns of such a prompt are welcome; ids match across a
source prefix, lineage/turns.py), and `files_for_run` returns the final drafter's lineage
files: the inherited continuations plus this run's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.errors import DFlashError
from dflash_trainer.lineage.record import (
    Lineage,
    PromptTurns,
    append,
    check_describes,
    lineage_dir,
    lineage_files,
    now,
    read_lineage,
    read_prompts,
    weights_sha256,
)
from dflash_trainer.lineage.reuse import find_reuse
from dflash_trainer.lineage.turns import RecordedTurns, count
from dflash_trainer.redact import redact_config


@dataclass
class Inheritance:
    """The start of a run: the drafter it continues (if any) and that drafter's lineage."""

    init_from: str | None = None
    weights_sha256: str | None = None
    parent: Lineage | None = None
    prompts: list[PromptTurns] = field(default_factory=list)

    @classmethod
    def of(cls, path: str, state: dict[str, torch.Tensor]) -> Inheritance:
        h = weights_sha256(state)
        parent = read_lineage(path)
        if parent is not None:
            check_describes(parent, h, str(lineage_dir(path)))
        return cls(path, h, parent, read_prompts(path) if parent else [])

    def used_turns(self) -> RecordedTurns:
        return RecordedTurns(self.prompts)


def check_fresh(inherited: Inheritance, data_path: Path | None) -> None:
    """Refuse training data that supervises a (prompt id, assistant turn) the start drafter's
    lineage already trained on, under its id or across a source prefix (`x` = `src/x`)."""
    from dflash_trainer.data.prepare import read_record_ids

    used = inherited.used_turns()
    if not used or data_path is None:
        return
    ids = read_record_ids(data_path)
    if ids is None:
        raise DFlashError(
            f"{data_path}: prepared without its record ids, so it cannot be checked against "
            f"the lineage of {inherited.init_from}; prepare it again with `dflash data prepare "
            f"--exclude-lineage {inherited.init_from}`"
        )
    reuse = find_reuse(used, ids)
    if reuse:
        other = (
            ", or, if those are other prompts that only share ids with recorded ones, give the "
            "records their own source-prefixed ids (`<source>/<id>`, as `dflash data prompts` "
            "writes them)"
            if reuse.across_prefix()
            else ""
        )
        raise DFlashError(
            f"{data_path}: {reuse.prompts:,} of its {len(ids):,} training prompts supervise "
            f"{reuse.turns_text()} an earlier continuation recorded in "
            f"{inherited.init_from}'s lineage already trained on ({reuse.details()}); prepare "
            f"the data with `dflash data prepare --exclude-lineage {inherited.init_from}` "
            "(those turns become context, their later turns stay; ids match across a source "
            f"prefix there too){other}, or regenerate fresh prompts"
        )


def data_summary(
    data_path: Path | None, manifest: Any
) -> tuple[dict[str, Any], PromptTurns | None]:
    """A continuation's `data`: counts of the prepared train split, per source, and its ids."""
    from dflash_trainer.data.prepare import read_record_ids

    m = manifest if isinstance(manifest, dict) else {}
    train = (m.get("splits") or {}).get("train") or {}
    ids = read_record_ids(data_path) if data_path is not None else None
    sources: dict[str, dict[str, Any]] = {}
    for name, row in (m.get("sources") or {}).items():
        sources[name] = {k: row.get(k) for k in ("documents", "tokens", "supervised_tokens")}
    for pid, turns in (ids or {}).items():
        head, sep, _ = pid.partition("/")
        if sep and head in sources:
            sources[head]["assistant_turns"] = sources[head].get("assistant_turns", 0) + count(
                turns
            )
    mixture = m.get("source_mixture") or {}
    data: dict[str, Any] = {
        "prepared": str(data_path) if data_path is not None else None,
        "fingerprint": m.get("fingerprint"),
        "source": (m.get("source") or {}).get("spec"),
        "documents": train.get("documents"),
        "assistant_turns": sum(map(count, ids.values())) if ids is not None else None,
        "supervised_tokens": train.get("supervised_tokens"),
        "tokens": train.get("tokens"),
        "sources": sources,
        "prompt_set": {k: mixture.get(k) for k in ("sources_spec", "seed")} if mixture else None,
        "settings": m.get("settings"),
    }
    return data, dict(ids) if ids is not None else None


def files_for_run(
    tr: Any, state: dict[str, torch.Tensor], config: dict[str, Any]
) -> dict[str, bytes]:
    """The final drafter's lineage files: the inherited lineage plus this run's continuation.
    `tr` is the Trainer (typed loosely: the trainer imports this module) and `config` its
    config as a dict."""
    inherited: Inheritance = tr.inherited
    manifest = getattr(tr.data.train, "manifest", None)
    data, ids = data_summary(tr.data.path, manifest)
    epochs = tr.position.epoch + tr.position.step / max(1, tr.batcher.steps_per_epoch)
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in state.values()})
    continuation = {
        "date": now(),
        "start": {"init_from": inherited.init_from, "weights_sha256": inherited.weights_sha256},
        "steps": tr.step,
        "epochs": round(epochs, 4),
        "tokens_seen": tr.tokens_seen * tr.world.world_size,
        "data": data,
        "config": redact_config(config)[0],  # a lineage travels with every export: no credentials
        "result": {"weights_sha256": weights_sha256(state), "dtype": ",".join(dtypes)},
        "exports": [],
        "evals": [],
    }
    lineage, prompts = append(inherited.parent, inherited.prompts, continuation, ids)
    return lineage_files(lineage, prompts)
