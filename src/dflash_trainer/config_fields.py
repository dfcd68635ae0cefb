"""One validation layer for every config field: declared rules, one checker.

Each field of a config section declares what it may hold with `setting(...)`: a numeric
range, a length, a set of choices, a path rule. `check_section` runs on construction
(every section's `__post_init__`) and checks every field against its annotation and
its rule, so a value reaches the trainer only through this one gate, whether it came
from a recipe, a `--set` override, a run directory's config.yaml or Python code.

Comparisons are written so that NaN fails them (`not lo <= x`), and float fields
reject NaN and inf before any range is looked at: a NaN learning rate used to pass
every `x <= 0` test and show up as `loss nan` after the target had loaded.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the field and the fix."""


def fail(path: str, msg: str) -> typing.NoReturn:
    raise ConfigError(f"{path}: {msg}")


SEED_MAX = 2**63 - 1  # torch.manual_seed and numpy take at most a signed 64-bit seed
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Rule:
    """What one field may hold (beyond its type annotation)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    """True: the lower bound itself is not allowed (x > lo)."""
    hi_open: bool = False
    min_len: int | None = None
    max_len: int | None = None
    item: Rule | None = None
    """Rule of each element of a tuple field."""
    choices: tuple[Any, ...] | None = None
    path: bool = False
    """A path or URL: a `scheme://` prefix must name a protocol fsspec knows."""
    local: bool = False
    """A local path: a `scheme://` URL is refused (it would be written as a local directory
    named after the scheme)."""
    file_name: bool = False
    """A bare file name: no directory part, so it cannot point outside its directory."""
    identifier_keys: bool = False
    """A mapping whose keys are attribute names (HF config fields)."""
    why: str = ""
    """Why the bound is there, added to the message (e.g. the memory it would take)."""

    def describe(self) -> str:
        if self.lo is None and self.hi is None:
            return ""
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        lo = "-inf" if self.lo is None else _num(self.lo)
        hi = "inf" if self.hi is None else _num(self.hi)
        return f"{left}{lo}, {hi}{right}"


def _num(x: float) -> str:
    if isinstance(x, int) and x >= 2**16:
        n = x.bit_length()
        return f"2**{n - 1}" if x == 2 ** (n - 1) else f"2**{n}-1" if x == 2**n - 1 else str(x)
    return f"{x:g}" if isinstance(x, float) else str(x)


def setting(default: Any = dataclasses.MISSING, *, factory: Any = None, **rule: Any) -> Any:
    """A dataclass field carrying its `Rule` in metadata."""
    meta = {"rule": Rule(**rule)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------- types


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against annotation `tp`, converting lists to tuples and ints to floats."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, path)
    if origin is Literal:
        choices = get_args(tp)
        if not any(value == c and type(value) is type(c) for c in choices):
            fail(path, f"must be one of {list(choices)}, got {value!r}")
        return value
    if origin is tuple:
        return _coerce_tuple(value, tp, path)
    if origin is dict:
        if not isinstance(value, dict):
            fail(path, f"expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            fail(path, f"expected a mapping of {tp.__name__} fields, got {value!r}")
        return build(tp, value, path)
    return _coerce_scalar(value, tp, path)


def _coerce_union(value: Any, tp: Any, path: str) -> Any:
    args = get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        fail(path, "must not be null")
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # `X | None`: X's own message (NaN, item types) says more
        return coerce(value, options[0], path)
    for arg in options:
        try:
            return coerce(value, arg, path)
        except ConfigError:
            continue
    fail(path, f"expected {_type_name(tp)}, got {value!r}")


def _coerce_tuple(value: Any, tp: Any, path: str) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        fail(path, f"expected a list, got {value!r}")
    args = get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        fail(path, f"expected {len(args)} items, got {len(value)}")
    return tuple(coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))


def _coerce_scalar(value: Any, tp: Any, path: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            fail(path, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        return _coerce_float(value, path)
    if tp is str:
        if not isinstance(value, str):
            fail(path, f"expected a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported annotation {tp!r} at {path}")


def _coerce_float(value: Any, path: str) -> float:
    if isinstance(value, str):
        # YAML 1.1 reads `3e-4` (no dot) as a string; accept what a user means.
        try:
            number = float(value)
        except ValueError:
            fail(path, f"expected a number, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        fail(path, f"expected a number, got {value!r}")
    else:
        try:
            number = float(value)
        except OverflowError:
            fail(path, f"expected a finite number, got {value!r} (too large for a float)")
    if not math.isfinite(number):
        fail(path, f"must be a finite number, got {number!r}")
    return number


def build(cls: type, data: dict[str, Any], path: str) -> Any:
    """Construct section `cls` from a mapping, rejecting unknown keys by name."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in data if k not in names)
    if unknown:
        where = f"{path}." if path else ""
        fail(
            f"{where}{unknown[0]}", f"unknown key; valid keys of {path or 'the config'} are {names}"
        )
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in data]
    if missing:
        where = f"{path}." if path else ""
        fail(
            f"{where}{missing[0]}", f"required key missing; {path or 'the config'} needs {required}"
        )
    kwargs = {k: coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)


# ---------------------------------------------------------------- rules


def check_section(obj: Any, section: str) -> None:
    """Type-check and range-check every field of a frozen section (normalising in place:
    lists become tuples, ints in float fields become floats)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        path = f"{section}.{f.name}" if section else f.name
        value = coerce(getattr(obj, f.name), hints[f.name], path)
        object.__setattr__(obj, f.name, value)
        rule = f.metadata.get("rule")
        if rule is not None and value is not None:
            check_value(value, rule, path)
        elif isinstance(value, dict):  # a free-form map with no rule of its own
            check_free_map(value, path)


def check_value(value: Any, rule: Rule, path: str) -> None:
    if isinstance(value, tuple):
        _check_length(len(value), rule, path, "entries")
        if rule.item is not None:
            for i, v in enumerate(value):
                check_value(v, rule.item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        if rule.identifier_keys:
            bad = [k for k in value if not (isinstance(k, str) and _NAME.match(k))]
            if bad:
                fail(path, f"keys must be field names (letters, digits, _), got {bad[:3]}")
        check_free_map(value, path)
        return
    if isinstance(value, str):
        _check_string(value, rule, path)
        return
    if isinstance(value, int | float) and not isinstance(value, bool):
        _check_range(value, rule, path)


FREE_MAP_DEPTH = 4
FREE_MAP_ITEMS = 256
FREE_MAP_STRING = 4096


def check_free_map(value: Any, path: str, depth: int = 0, budget: list[int] | None = None) -> None:
    """A free-form map (storage_options, hf_config_overrides) holds plain YAML values, at most
    FREE_MAP_DEPTH deep, FREE_MAP_ITEMS values in all and strings of FREE_MAP_STRING chars:
    what such options need, and not a way to smuggle megabytes into every run's config."""
    budget = [FREE_MAP_ITEMS] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        fail(path, f"too many values in this map (at most {FREE_MAP_ITEMS} in all)")
    if isinstance(value, dict | list | tuple):
        if depth >= FREE_MAP_DEPTH:
            fail(path, f"nested more than {FREE_MAP_DEPTH} levels deep")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(value, dict) and not isinstance(k, str):
                fail(path, f"keys must be strings, got {k!r}")
            check_free_map(v, f"{path}.{k}" if isinstance(value, dict) else f"{path}[{k}]",
                           depth + 1, budget)  # fmt: skip
    elif isinstance(value, str):
        if len(value) > FREE_MAP_STRING:
            fail(path, f"a string of {len(value)} characters; at most {FREE_MAP_STRING}")
    elif isinstance(value, float):
        if not math.isfinite(value):
            fail(path, f"must be a finite number, got {value!r}")
    elif not (value is None or isinstance(value, int | bool)):
        fail(path, f"must be a plain value (text, number, true/false, list, map), got {value!r}")


def _check_length(n: int, rule: Rule, path: str, unit: str) -> None:
    if rule.min_len is not None and n < rule.min_len:
        fail(path, f"must not be empty (at least {rule.min_len} {unit})")
    if rule.max_len is not None and n > rule.max_len:
        fail(path, f"has {n} {unit}; at most {rule.max_len} allowed")


def _check_range(x: float, rule: Rule, path: str) -> None:
    ok = True
    if rule.lo is not None:
        ok = (x > rule.lo) if rule.lo_open else (x >= rule.lo)
    if ok and rule.hi is not None:
        ok = (x < rule.hi) if rule.hi_open else (x <= rule.hi)
    if not ok:  # NaN reaches here: every comparison with it is false
        why = f" ({rule.why})" if rule.why else ""
        fail(path, f"must be in {rule.describe()}, got {x!r}{why}")


def _check_string(s: str, rule: Rule, path: str) -> None:
    if rule.choices is not None and s not in rule.choices:
        fail(path, f"must be one of {list(rule.choices)}, got {s!r}")
    _check_length(len(s), rule, path, "characters")
    if rule.file_name and ("/" in s or "\\" in s or s in (".", "..")):
        fail(path, f"must be a file name inside target.name_or_path, not a path: {s!r}")
    if rule.local and URL.match(s):
        fail(path, f"must be a local directory, not a URL ({s!r}); {rule.why}")
    if rule.path:
        check_protocol(s, path)


URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
"""A `scheme://` prefix (group 1: the scheme): what tells a URL from a local path."""


def check_protocol(s: str, path: str) -> None:
    """A `scheme://` URL must name a protocol fsspec knows and can load here."""
    m = URL.match(s)
    if m is None:
        return
    proto = m.group(1).lower()
    if proto == "file":
        return
    try:
        import fsspec
        from fsspec.registry import known_implementations, registry
    except ImportError:
        fail(path, f"{s!r} is a {proto}:// URL but fsspec is not installed; use a local path")
    if proto not in known_implementations and proto not in registry:
        known = sorted(known_implementations)
        fail(path, f"unknown protocol {proto!r} in {s!r}; fsspec knows {known}")
    try:
        fsspec.get_filesystem_class(proto)
    except (ImportError, ValueError) as e:
        fail(path, f"protocol {proto!r} is known to fsspec but not installed here: {e}")
