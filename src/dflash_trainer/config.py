"""Run configuration: YAML recipes and files, dotted overrides, one validation layer.

One representation end to end: a recipe (YAML) plus `section.field=value` overrides
becomes a `Config`. The sections live in config_sections.py, where every field
declares its allowed range; config_fields.py checks every field on construction, so
a recipe, an override, a run directory's config.yaml and Python code all pass the same
gate. Any mistake raises `ConfigError` with the dotted field name and the fix,
because a typo that silently falls back to a default is how multi-day runs go wrong.
"""

from __future__ import annotations

import dataclasses
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from dflash_trainer.config_fields import ConfigError, build
from dflash_trainer.config_sections import (
    GEOMETRY_PRESETS,
    LAYER_TYPES,
    Config,
    DataConfig,
    DistributedConfig,
    DrafterConfig,
    EvalConfig,
    RunConfig,
    SourceConfig,
    TargetConfig,
    TrainingConfig,
)
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import read_small_text
from dflash_trainer.yaml_input import strict_load

CONFIG_BYTES = 4 << 20
"""A config is a few kilobytes; a file of megabytes named by --config is another file."""

__all__ = [
    "GEOMETRY_PRESETS",
    "LAYER_TYPES",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "DrafterConfig",
    "EvalConfig",
    "RunConfig",
    "SourceConfig",
    "TargetConfig",
    "TrainingConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "load_yaml",
    "recipe_names",
    "recipe_path",
    "replace",
]

# ---------------------------------------------------------------- building from dicts


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from a nested mapping."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    result: Config = build(Config, data, "")
    return result


def config_to_dict(cfg: Any) -> Any:
    """Plain nested dict (lists instead of tuples) suitable for YAML/JSON."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple | list):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def _override_value(item: str, raw: str) -> Any:
    if not raw.strip():
        return None
    try:
        return strict_load(raw)
    except (RecursionError, ValueError, OverflowError) as e:
        raise ConfigError(f"override {item!r}: the value is not a config value ({e})") from e
    except yaml.YAMLError as e:
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            f"override {item!r}: the value is not valid YAML ({what}); "
            "quote strings, write lists as [a, b]"
        ) from e


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a nested dict copy."""
    out = yaml.safe_load(yaml.safe_dump(data)) or {}
    section_names = {f.name: f.type for f in dataclasses.fields(Config)}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r}: expected section.field=value, e.g. training.lr=3e-4"
            )
        key, raw = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if parts[0] not in section_names or not _KEY.match(key):
            raise ConfigError(
                f"override {item!r}: the key must start with a section "
                f"({', '.join(section_names)}) followed by dotted field names, "
                "e.g. training.lr=3e-4"
            )
        value = _override_value(item, raw)
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
                node[part] = child
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = value
    return out


# ---------------------------------------------------------------- recipes and files

_RECIPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _recipes_dir() -> Path:
    return Path(str(resources.files("dflash_trainer") / "recipes"))


def recipe_names() -> list[str]:
    return sorted(p.name[:-5] for p in _recipes_dir().iterdir() if p.name.endswith(".yaml"))


def recipe_path(name: str) -> Path:
    """The bundled recipe `name`; a path (or anything resolving outside the recipes
    directory) is refused: files are what --config is for."""
    root = _recipes_dir().resolve()
    path = (root / f"{name}.yaml").resolve()
    if not _RECIPE_NAME.match(name) or ".." in name or path.parent != root:
        raise ConfigError(
            f"--recipe {name!r}: takes the name of a bundled recipe ({', '.join(recipe_names())}), "
            "not a path; to use a YAML file, pass it with --config FILE"
        )
    if not path.is_file():
        raise ConfigError(f"unknown recipe {name!r}; available recipes: {recipe_names()}")
    return path


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A config or recipe file: a regular UTF-8 file of YAML without aliases or duplicate
    keys (yaml_input.py says why), holding a mapping."""
    p = Path(path)
    if not os.path.lexists(p):
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        text = read_small_text(p, "config file", CONFIG_BYTES)
    except DFlashError as e:
        raise ConfigError(str(e)) from None
    try:
        data = strict_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}: {what}") from e
    except (RecursionError, ValueError, OverflowError) as e:  # depth; a date like 2001-02-30
        raise ConfigError(f"config file {str(p)!r}: not a config ({type(e).__name__}: {e})") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return data


def load_config(
    recipe: str | None = None, config_file: str | None = None, overrides: list[str] | None = None
) -> Config:
    """Recipe or file (not both), then dotted overrides, then validation."""
    if recipe and config_file:
        raise ConfigError("give either --recipe or --config, not both")
    data: dict[str, Any] = {}
    if recipe:
        data = load_yaml(recipe_path(recipe))
    elif config_file:
        data = load_yaml(config_file)
    data = apply_overrides(data, list(overrides or []))
    return config_from_dict(data)


def replace(cfg: Config, **sections: Any) -> Config:
    """dataclasses.replace over sections: replace(cfg, training={'lr': 1e-3})."""
    updates = {}
    for name, changes in sections.items():
        updates[name] = dataclasses.replace(getattr(cfg, name), **changes)
    return dataclasses.replace(cfg, **updates)
