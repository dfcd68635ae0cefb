"""Credentials never reach a run directory in clear.

`run.storage_options` is handed to fsspec and may carry an S3 key and secret, a token, a
password. A run directory is copied, shared and attached to bug reports, so what the
trainer writes there (`config.yaml`, `run_info.json` and its argv) leaves such values out:
an option whose name says it is a credential (key, secret, token, password, credential,
...) or whose value looks like one (a known token prefix, or a long unbroken mix of
letters and digits) is dropped from the config and masked in the command line, and a note
says which options were left out and where they go instead: the environment variables
fsspec reads (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) or an override given again
on `dflash train --resume`.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

MASK = "<redacted>"
_SECRET_NAME = re.compile(
    r"key|secret|token|passw|credential|auth|session|signature|private|cookie|bearer|"
    r"pwd|(^|_)(pass|creds?|sas|login|pin)($|_)|conn(ection)?_?str|(^|_)access_?id",
    re.I,
)
_TOKEN_PREFIX = re.compile(r"^(hf_|ghp_|gho_|github_pat_|glpat-|sk-|xox[abpr]-|AKIA|ASIA|ya29\.)")
_OPAQUE = re.compile(r"^[A-Za-z0-9+/=_\-.]{20,}$")
_EMBEDDED = re.compile(
    # a credential inside a longer value: a URL's user:password@, a connection string's
    # AccountKey=..., a query's sig=..., an Authorization header's value
    r"://[^/@\s:]+:[^/@\s]+@|"
    r"(accountkey|sharedaccesskey|sharedaccesssignature|password|passwd|pwd|secret|token|"
    r"sig|api_?key)=|"
    r"\b(bearer|basic|token)\s+\S",
    re.I,
)
NOTE = (
    "credentials in run.storage_options are not written here ({names}); give them through "
    "the environment variables the storage reads (e.g. AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY for s3://) or again as overrides on --resume"
)


def looks_secret(name: str, value: Any) -> bool:
    """A credential by its option name, or a string value shaped like a token or holding one."""
    if _SECRET_NAME.search(name):
        return True
    if not isinstance(value, str):
        return False
    if _TOKEN_PREFIX.match(value) or _EMBEDDED.search(value):
        return True
    mixed = sum(bool(re.search(p, value)) for p in ("[a-z]", "[A-Z]", "[0-9]")) == 3
    return bool(_OPAQUE.match(value)) and mixed


_DROP = object()


def _split(value: Any, name: str, key: str) -> tuple[Any, list[str]]:
    """(`value` without credentials or _DROP, dotted names of those left out). Maps and lists
    are walked (a list of headers, of client options); a plain value is judged by the name of
    the option that holds it (`key`, the list's own name for its items) and its shape."""
    if isinstance(value, dict):
        kept: dict[Any, Any] = {}
        dropped: list[str] = []
        for k, v in value.items():
            where = f"{name}.{k}" if name else str(k)
            if _SECRET_NAME.search(str(k)):  # all of it, a map of OAuth fields as a string
                dropped.append(where)
                continue
            inner, more = _split(v, where, str(k))
            dropped += more
            if inner is not _DROP:
                kept[k] = inner
        return kept, dropped
    if isinstance(value, list | tuple):
        items: list[Any] = []
        dropped = []
        for i, v in enumerate(value):
            inner, more = _split(v, f"{name}[{i}]", key)
            dropped += more
            if inner is not _DROP:
                items.append(inner)
        return items, dropped
    if looks_secret(key, value):
        return _DROP, [name]
    return value, []


def split_secrets(options: Any, prefix: str = "") -> tuple[Any, list[str]]:
    """(options without credentials, dotted names of those left out), nested maps and lists
    included."""
    if not isinstance(options, dict):
        return options, []
    kept, dropped = _split(options, prefix.rstrip("."), "")
    return kept, dropped


def redact_config(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A config dict (config_to_dict) safe to write, and the storage options left out."""
    run = data.get("run")
    if not isinstance(run, dict):
        return data, []
    kept, dropped = split_secrets(run.get("storage_options") or {})
    return {**data, "run": {**run, "storage_options": kept}}, dropped


def redact_argv(argv: list[str]) -> list[str]:
    """The command line with credential values of storage_options overrides masked."""
    return [_redact_word(w) for w in argv]


def _redact_word(word: str) -> str:
    if "storage_options" not in word or "=" not in word:
        return word
    flag, sep, rest = word.partition("=")
    if flag == "--set":  # `--set=run.storage_options.x=v`: the override is after the flag
        return f"{flag}{sep}{_redact_word(rest)}"
    key, value = word.split("=", 1)
    last = key.rsplit(".", 1)[-1]
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return f"{key}={MASK}"  # unreadable: it may still hold a secret
    if last != "storage_options":  # one option, maybe a list or a map of them
        secret = looks_secret(last, value) or bool(_split({last: parsed}, "", "")[1])
        return f"{key}={MASK}" if secret else word
    if not split_secrets(parsed)[1]:
        return word
    masked = _mask(parsed)
    return f"{key}={yaml.safe_dump(masked, default_flow_style=True).strip()}"


def _mask(options: Any, key: str = "") -> Any:
    if isinstance(options, dict):
        return {k: _mask(v, str(k)) for k, v in options.items()}
    if isinstance(options, list | tuple):
        return [_mask(v, key) for v in options]
    return MASK if looks_secret(key, options) else options
