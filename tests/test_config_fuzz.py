"""Property-based fuzzing of the config tree and the CLI override syntax.

For every generated config (any field of any section, values inside, on and outside
the declared ranges, NaN/inf, wrong types, unknown keys) and every generated list of
command-line overrides (positional `a.b=v`, `--set a.b=v`, `--set=a.b=v`, garbage),
the validation `doctor`, `plan` and `train --dry-run` run either accepts a config
that then builds (Config round-trips through YAML, the drafter spec resolves against
a tiny real target config, the hf_config_overrides apply to it) or rejects it with a
ConfigError / DFlashError whose message names the field. Any other exception, or an
example that takes more than a few seconds, fails the test.

Examples are derandomized so CI sees the same ones; the counts are printed at the end
of the module and written to <pytest basetemp>/config_fuzz_counts.json.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import typing
from collections import Counter
from collections.abc import Iterator
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml
from fuzz_support import FUZZ, SECONDS_PER_EXAMPLE, show, time_limit
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from dflash_trainer import cli
from dflash_trainer.config import Config, ConfigError, config_from_dict, config_to_dict
from dflash_trainer.config_fields import Rule
from dflash_trainer.core.geometry import resolve_drafter_spec
from dflash_trainer.errors import DFlashError
from dflash_trainer.target.configs import apply_hf_overrides

COUNTS: Counter[str] = Counter()

# The tiny target every accepted config must build against (built in code, no files).
TARGET = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=256,
)
# A base that resolves against TARGET, so generated fields are what decides.
BASE: dict[str, Any] = {"drafter": {"mask_token_id": 5, "geometry": "small", "num_layers": 2}}


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


SECTIONS = _sections()
FIELD_PATHS = {
    f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
}


# ---------------------------------------------------------------- value strategies

WRONG_TYPES = st.one_of(
    st.text(max_size=6),
    st.booleans(),
    st.lists(st.integers(-3, 3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
    st.just(None),
)
HF_KEYS = ["num_hidden_layers", "rms_norm_eps", "vocab_size", "tie_word_embeddings", "nope"]


def _number(tp: type, rule: Rule | None) -> st.SearchStrategy[Any]:
    lo = rule.lo if rule and rule.lo is not None else -10
    hi = rule.hi if rule and rule.hi is not None else 10**6
    if tp is int:
        lo_i, hi_i = int(lo), int(min(hi, 2**64))
        near = st.sampled_from([lo_i - 1, lo_i, lo_i + 1, hi_i - 1, hi_i, hi_i + 1])
        inside = st.integers(lo_i, min(hi_i, lo_i + 64))
        return st.one_of(inside, inside, inside, near, st.integers(-(2**70), 2**70))
    edge = st.sampled_from([lo, hi, math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, 5e-324])
    inside_f = st.floats(float(lo), float(min(hi, 1e6)), allow_nan=False)
    return st.one_of(inside_f, inside_f, inside_f, edge, st.floats(), st.integers(-5, 5))


def _strategy(tp: Any, rule: Rule | None) -> st.SearchStrategy[Any]:
    origin = get_origin(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return st.one_of(st.none(), *[_strategy(a, rule) for a in inner])
    if origin is Literal:
        choices = st.sampled_from(get_args(tp))
        return st.one_of(choices, choices, choices, st.text(max_size=5))
    if origin is tuple:
        args = get_args(tp)
        item_rule = rule.item if rule else None
        item = _strategy(args[0], item_rule)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(item, max_size=7)
        return st.lists(item, min_size=len(args) - 1, max_size=len(args) + 1)
    if origin is dict:
        values = st.one_of(st.integers(-2, 64), st.floats(), st.text(max_size=4), st.booleans())
        keys = st.one_of(st.sampled_from(HF_KEYS), st.text(max_size=4), st.integers(0, 3))
        return st.dictionaries(keys, values, max_size=3)
    if tp is bool:
        return st.booleans()
    if tp in (int, float):
        return _number(tp, rule)
    if tp is str:
        choices = list(rule.choices) if rule and rule.choices else []
        fixed = ["x", "runs/r", "s3://b/r", "memory://r", "nope://r", "../x", "a/b.gguf", "gsm8k"]
        return st.one_of(st.sampled_from(choices + fixed), st.text(max_size=12))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):  # a nested section (data.sources)
        return st.fixed_dictionaries(
            {}, optional={f.name: _field_strategy(tp, f) for f in dataclasses.fields(tp)}
        )
    raise AssertionError(tp)


def _field_strategy(cls: type, f: dataclasses.Field[Any]) -> st.SearchStrategy[Any]:
    tp = typing.get_type_hints(cls)[f.name]
    good = _strategy(tp, f.metadata.get("rule"))
    return st.one_of(*[good] * 6, WRONG_TYPES)


FIELDS = [
    (name, f.name, _field_strategy(cls, f))
    for name, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
]


@st.composite
def config_edits(draw: st.DrawFn) -> list[tuple[str, str, Any]]:
    """1-4 (section, field, value) edits; now and then an unknown key."""
    picks = draw(st.lists(st.sampled_from(range(len(FIELDS))), min_size=1, max_size=4))
    edits = [(FIELDS[i][0], FIELDS[i][1], draw(FIELDS[i][2])) for i in picks]
    if draw(st.integers(0, 19)) == 0:
        edits.append((draw(st.sampled_from(list(SECTIONS))), draw(st.text(max_size=5)), 1))
    return edits


# ---------------------------------------------------------------- the property


@pytest.fixture(scope="module", autouse=True)
def report_counts(request, tmp_path_factory) -> Iterator[None]:
    yield
    out = tmp_path_factory.getbasetemp() / "config_fuzz_counts.json"
    counts = {k: COUNTS[k] for k in ("generated", "accepted", "rejected", "tracebacks")}
    out.write_text(json.dumps(counts, indent=1))
    show(request, f"config fuzz: {json.dumps(counts)} ({out})")


def builds(cfg: Config) -> None:
    """What an accepted config must survive: the YAML round trip of a run directory,
    the drafter spec against a real target config, the target overrides on it."""
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(config_to_dict(cfg))))
    assert again == cfg
    target = copy.deepcopy(TARGET)
    apply_hf_overrides(target, cfg.target.hf_config_overrides)
    resolve_drafter_spec(cfg.drafter, target)


def judge(make: Any, touched: list[str]) -> None:
    """Run `make()` (which validates) then `builds`; classify the outcome."""
    COUNTS["generated"] += 1
    try:
        with time_limit(SECONDS_PER_EXAMPLE, "example"):
            cfg = make()
            builds(cfg)
    except (ConfigError, DFlashError) as e:
        msg = str(e)
        named = any(p in msg for p in FIELD_PATHS | set(touched)) or msg.startswith("override ")
        assert named, f"rejected without naming the field: {msg!r} for {touched}"
        COUNTS["rejected"] += 1
        return
    except Exception:
        COUNTS["tracebacks"] += 1
        raise
    COUNTS["accepted"] += 1


@FUZZ
@given(config_edits())
def test_any_config_tree_is_accepted_and_builds_or_rejected_by_name(edits):
    data = copy.deepcopy(BASE)
    for section, name, value in edits:
        data.setdefault(section, {})[name] = value
    judge(lambda: config_from_dict(data), [f"{s}.{n}" for s, n, _ in edits])


def _yaml_word(value: Any) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**6)
        .strip()
        .removesuffix("...")
        .strip()
    )


@st.composite
def override_words(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    """(argv words, the overrides they mean in order): each override in one of the three
    command-line forms, or now and then a malformed one."""
    words: list[str] = []
    meant: list[str] = []
    for section, name, value in draw(config_edits()):
        item = f"{section}.{name}={_yaml_word(value)}"
        if draw(st.integers(0, 9)) == 0:
            item = draw(st.sampled_from(["training.lr", f"{section}..{name}=1", f"{name}=1"]))
        form = draw(st.sampled_from(["positional", "set", "set="]))
        words += (
            [item]
            if form == "positional"
            else ["--set", item]
            if form == "set"
            else [f"--set={item}"]
        )
        meant.append(item)
        if draw(st.booleans()):
            words.append("--json")  # an option between overrides: the argparse trap
    return words, meant


@settings(FUZZ, max_examples=200)
@given(override_words())
def test_any_override_list_on_the_command_line(words_meant):
    words, meant = words_meant
    parser = cli._build_parser("plan")
    args = cli._parse(parser, ["plan", "--recipe", "smollm2-135m-demo", *words])
    assert args.overrides == meant  # every form, in command-line order
    from dflash_trainer.config import load_config

    base = [f"drafter.{k}={v}" for k, v in BASE["drafter"].items()]
    keys = [w.split("=", 1)[0] for w in meant]  # an unknown key is named without its value
    judge(lambda: load_config(recipe="smollm2-135m-demo", overrides=base + meant), meant + keys)
