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
    r"key|secret|token|passw|credential|auth|session|signature|private|cookie|bearer", re.I
)
_TOKEN_PREFIX = re.compile(r"^(hf_|ghp_|gho_|github_pat_|glpat-|sk-|xox[abpr]-|AKIA|ASIA|ya29\.)")
_OPAQUE = re.compile(r"^[A-Za-z0-9+/=_\-.]{20,}$")
NOTE = (
    "credentials in run.storage_options are not written here ({names}); give them through "
    "the environment variables the storage reads (e.g. AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY for s3://) or again as overrides on --resume"
)


def looks_secret(name: str, value: Any) -> bool:
    """A credential by its option name, or a string value shaped like a token."""
    if _SECRET_NAME.search(name):
        return True
    if not isinstance(value, str):
        return False
    if _TOKEN_PREFIX.match(value):
        return True
    mixed = sum(bool(re.search(p, value)) for p in ("[a-z]", "[A-Z]", "[0-9]")) == 3
    return bool(_OPAQUE.match(value)) and mixed


def split_secrets(options: Any, prefix: str = "") -> tuple[Any, list[str]]:
    """(options without credentials, dotted names of those left out), nested maps included."""
    if not isinstance(options, dict):
        return options, []
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    for k, v in options.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            inner, more = split_secrets(v, f"{name}.")
            kept[k] = inner
            dropped += more
        elif looks_secret(str(k), v):
            dropped.append(name)
        else:
            kept[k] = v
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
    key, value = word.split("=", 1)
    last = key.rsplit(".", 1)[-1]
    if last != "storage_options":
        return f"{key}={MASK}" if looks_secret(last, value) else word
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return f"{key}={MASK}"  # unreadable: it may still hold a secret
    if not split_secrets(parsed)[1]:
        return word
    masked = _mask(parsed)
    return f"{key}={yaml.safe_dump(masked, default_flow_style=True).strip()}"


def _mask(options: Any) -> Any:
    if not isinstance(options, dict):
        return options
    return {
        k: _mask(v) if isinstance(v, dict) else (MASK if looks_secret(str(k), v) else v)
        for k, v in options.items()
    }
