"""A resume continues the run it names, or says why not.

The config of a resumed run is compared twice with the run's own: first with `RUN/config.yaml`
(before the target is loaded, so a wrong override is refused at once), then with what the
checkpoint being resumed says trained it (its meta.json sections, its spec.json geometry and
the identity of its prepared data), which also catches an edited config.yaml.

Each differing field is one of three kinds:
- harmless (how often to log, evaluate or checkpoint, where to write): allowed silently;
- noted (the run's length, how the same step is computed): allowed, with a note saying what
  it changes (the schedule's length; bit-for-bit equality with an uninterrupted run);
- everything else changes what is trained (target and its layers, drafter geometry, block
  size, seed, data and its identity, token budget, accumulation, loss, optimizer...): refused
  with the list `field: old -> new`, unless `--allow-config-change`, which warns and records
  the changes in run_info.json. A field unknown to this list counts as changing the run.
A drafter whose weight shapes differ cannot continue at all, with or without the flag.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trainer.config import Config, ConfigError, config_to_dict, load_yaml
from dflash_trainer.errors import DFlashError

Log = Callable[[str], None]

HARMLESS = (
    "training.log_every",
    "training.checkpoint_every",
    "training.keep_last",
    "training.eval_every",
    "training.max_bad_steps",
    "run.",
    "eval.",
)
NOTED = {
    "training.max_steps": "the learning-rate schedule now spans the new length",
    "training.epochs": "the learning-rate schedule now spans the new length",
    "drafter.init_from": "the checkpoint's weights replace the initialisation",
    "data.eval": "in-training evaluations now use other held-out data",
    "training.compile": "same objective; the losses may differ from an uninterrupted run's "
    "in the last bits",
    "training.device": "same objective, computed elsewhere: not bit for bit",
    "training.precision": "same objective at another precision: not bit for bit",
    "training.step_path": "same objective, another step implementation: not bit for bit",
    "training.target_chunk_tokens": "same objective, other chunks: not bit for bit",
    "training.loss_chunk_rows": "same objective, other chunks: not bit for bit",
    "training.target_attention": "same objective, another attention kernel: not bit for bit",
    "target.attn_implementation": "same target, another attention kernel: not bit for bit",
    "distributed.": "same objective, placed differently: not bit for bit",
}


@dataclass(frozen=True)
class Change:
    field: str
    old: Any
    new: Any
    note: str | None  # None: changes what is trained

    def __str__(self) -> str:
        return f"{self.field}: {_short(self.old)} -> {_short(self.new)}"

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "old": self.old, "new": self.new}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    """{"section.field": value} of a config dict, values JSON-normalised (tuples -> lists);
    a field's value (a list, a map such as storage_options) is compared whole."""
    out: dict[str, Any] = {}
    for section, fields in config.items():
        if isinstance(fields, dict):
            for key, value in fields.items():
                out[f"{section}.{key}"] = json.loads(json.dumps(value, default=str))
    return out


def _kind(field: str) -> str | None:
    """ "" for harmless, a note for noted, None for a field that changes the run."""
    if any(field == h or (h.endswith(".") and field.startswith(h)) for h in HARMLESS):
        return ""
    for key, note in NOTED.items():
        if field == key or (key.endswith(".") and field.startswith(key)):
            return note
    return None


PATHS = ("target.name_or_path", "target.gguf_file", "data.train")
"""Where the target and data are: a run directory moved with them changes these paths."""


def _moved(field: str, old: Any, new: Any) -> bool:
    """The same file or directory name at another path (a moved run): its content is
    checked otherwise (the drafter's geometry against the target's, the prepared data's
    fingerprint), so the path alone does not change the run."""
    if field not in PATHS or not isinstance(old, str) or not isinstance(new, str):
        return False
    return Path(old.rstrip("/")).name == Path(new.rstrip("/")).name != ""


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The fields that differ, of those both configs have (a field added to the config
    since the run started is not a change; harmless ones are left out)."""
    a, b = _flat(old), _flat(new)
    out = []
    for field in sorted(a.keys() & b.keys()):
        if a[field] != b[field]:
            note = _kind(field)
            if note is None and _moved(field, a[field], b[field]):
                note = "the same name at another path (a moved run?): its content is still checked"
            if note != "":
                out.append(Change(field, a[field], b[field], note))
    return out


def judge(changes: list[Change], allow: bool, where: str, log: Log) -> list[Change]:
    """Refuse changes of the run (unless `allow`), note the others; those to record."""
    altering = [c for c in changes if c.note is None]
    if altering and not allow:
        listed = "; ".join(str(c) for c in altering)
        raise DFlashError(
            f"--resume {where}: this config changes what the run trains ({listed}). Resume "
            "with the run's values (drop those overrides or edits), start a new run "
            "(another run.output_dir, or drafter.init_from=<checkpoint> to start from its "
            "weights), or pass --allow-config-change to continue with them anyway (recorded "
            "in run_info.json)"
        )
    for c in altering:
        log(f"--allow-config-change: {c} (the run no longer continues as it started)")
    for c in changes:
        if c.note is not None:
            log(f"resume with {c}: {c.note}")
    return changes


def saved_config(run_dir: Path, log: Log) -> dict[str, Any] | None:
    """RUN/config.yaml as a dict; None (said) when absent or unreadable."""
    path = run_dir / "config.yaml"
    if not os.path.lexists(path):
        return None
    try:  # a regular file of strict YAML (config.load_yaml), as every config is read
        return load_yaml(path)
    except ConfigError as e:
        log(f"{e}; the config is checked against the checkpoint's record only")
        return None


def check_saved_config(run_dir: Path, cfg: Config, allow: bool, log: Log) -> list[Change]:
    """The first check: this config against RUN/config.yaml (before the target loads)."""
    saved = saved_config(run_dir, log)
    if saved is None:
        return []
    return judge(config_changes(saved, config_to_dict(cfg)), allow, str(run_dir), log)


SECTIONS = ("target", "drafter", "training", "data")
"""The config sections a checkpoint's meta.json records (train_state.run_meta)."""


def check_checkpoint_config(
    data: Any, cfg: Config, known: list[Change], allow: bool, log: Log
) -> list[Change]:
    """The second check, before the target loads: this config against the sections the
    checkpoint being resumed (`data`, a CheckpointData) recorded in its meta.json, so an
    edited or damaged config.yaml is refused at once, not after minutes of loading. Fields
    `known` (the first check's) are not judged again. Returns the new changes."""
    meta = data.meta if isinstance(data.meta, dict) else {}
    sections = {k: meta[k] for k in SECTIONS if isinstance(meta.get(k), dict)}
    mine = {k: config_to_dict(getattr(cfg, k)) for k in sections}
    fields = {c.field for c in known}
    new = [c for c in config_changes(sections, mine) if c.field not in fields]
    return judge(new, allow, data.location, log)


def check_checkpoint(tr: Any, data: Any) -> list[Change]:
    """The second check: trainer `tr`'s run against the checkpoint it resumes (`data`, a
    CheckpointData). Changes the first check judged are not repeated; new ones allowed by
    --allow-config-change are added to run_info.json. Returns the new ones."""
    from dflash_trainer.train.run_dir import record_config_changes
    from dflash_trainer.train.train_state import run_meta

    if not data.meta and not data.spec:
        tr._warn(f"{data.location} has no record of its run (meta.json, spec.json): its "
                 "config cannot be compared")  # fmt: skip
        return []
    changes = checkpoint_changes(
        data.meta, data.spec, run_meta(tr), tr.spec.to_dict(), data.location
    )
    fields = {c.field for c in tr._config_changes}
    new = [c for c in changes if c.field not in fields]
    judge(new, tr.allow_config_change, data.location, tr._warn)
    if new and tr.world.is_main:
        record_config_changes(tr.run_dir, [c.to_dict() for c in new], tr._warn)
    return new


def geometry_problems(saved: dict[str, Any], mine: dict[str, Any]) -> tuple[list[str], dict]:
    """(weight-shape differences, other spec differences) between two spec dicts."""
    hard, soft = [], {}
    for key in sorted(saved.keys() & mine.keys()):
        if saved[key] == mine[key]:
            continue
        if key == "block_size":  # no weight's dimension: the run could continue
            soft[f"drafter spec {key}"] = (saved[key], mine[key])
        else:
            hard.append(f"{key}: {_short(saved[key])} -> {_short(mine[key])}")
    return hard, soft


def checkpoint_changes(
    meta: dict[str, Any],
    spec: dict[str, Any],
    current_meta: dict[str, Any],
    current_spec: dict[str, Any],
    location: str,
) -> list[Change]:
    """What differs between a checkpoint's record of its run and this run's.

    A weight-shape difference is a DFlashError at once: those weights cannot be loaded.
    """
    hard, soft = geometry_problems(spec, current_spec)
    if hard:
        raise DFlashError(
            f"{location} holds a drafter of another geometry ({'; '.join(hard)}); it cannot "
            "continue with this config, even with --allow-config-change. Resume with the "
            "run's drafter settings, or start a new run with drafter.init_from set to it "
            "(after making the drafter section match)"
        )
    sections: dict[str, Any] = {k: meta[k] for k in SECTIONS if k in meta}
    mine: dict[str, Any] = {k: current_meta[k] for k in sections if k in current_meta}
    changes = config_changes(sections, mine)
    changes += [Change(k, a, b, None) for k, (a, b) in soft.items()]
    data_change = _data_change(meta.get("prepared"), current_meta.get("prepared"))
    if data_change is not None:
        changes.append(data_change)
    return changes


def _data_change(old: Any, new: Any) -> Change | None:
    """The prepared data's identity, if it changed: its fingerprint, or (checkpoints
    written before fingerprints were recorded) the train split's counts."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None
    if old.get("fingerprint") and new.get("fingerprint"):
        key = "fingerprint"
        a, b = old["fingerprint"], new["fingerprint"]
    else:
        key = "train"
        a, b = old.get("train"), new.get("train")
        if not isinstance(a, dict) or not isinstance(b, dict):
            return None
    return None if a == b else Change(f"data (prepared {key})", a, b, None)
