"""A local model or tokenizer directory checked before a library reads it.

transformers builds what a `config.json` describes before it looks at a single weight: a
config that says `num_hidden_layers: 1000000000` makes it build a list of a billion layer
types, then a billion modules, for as long as memory lasts. No real model comes near the
bounds below; a count or size beyond them is a damaged or hostile file, refused naming the
field, before the library is called. The file itself is read as any JSON the tool reads
(json_input: a regular file, bounded in size and depth); a file that is not JSON at all is
left to the library, whose own error names it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import check_model_dir, read_small_bytes
from dflash_trainer.json_input import parse_json

MAX_COUNT = 1 << 16
"""num_* fields (layers, heads, experts): the largest models have a few hundred."""
MAX_SIZE = 1 << 24
"""*_size and *_dim fields (hidden, intermediate, vocabulary): the largest are ~10^6."""
MAX_POSITIONS = (1 << 31) - 1
CONFIG_BYTES = 16 << 20


def size_limit(key: str) -> int | None:
    """The largest value a real model has for the integer config field `key`, or None for a
    field that counts or sizes nothing."""
    if key.startswith("max_position_embeddings"):
        return MAX_POSITIONS
    if key.startswith("num_"):
        return MAX_COUNT
    if key.endswith(("_size", "_dim")):
        return MAX_SIZE
    return None


def check_sizes(config: Any, where: str, path: str = "") -> None:
    """Every count and size of `config` (a config.json object, sub-configs included) within
    the bounds of a real model."""
    if not isinstance(config, dict):
        return
    for key, value in config.items():
        name = f"{path}{key}"
        if isinstance(value, dict):
            check_sizes(value, where, f"{name}.")
            continue
        limit = size_limit(str(key))
        if limit is None or not isinstance(value, int) or isinstance(value, bool):
            continue
        if value > limit:
            raise DFlashError(
                f"{where}: {name} is {value:,}; no model has more than {limit:,} (the file "
                "is damaged or not a model's config.json): fix or replace it"
            )


def _config(path: Path, what: str) -> Any:
    """The JSON value of `path`/config.json, or None where there is none or it is not JSON
    (left to the library, which names what it cannot read)."""
    config = path / "config.json"
    if not config.is_file():
        return None
    raw = read_small_bytes(config, f"{what}: config.json", CONFIG_BYTES)
    try:
        return parse_json(raw.decode("utf-8"), f"{what}: {config}")
    except UnicodeDecodeError:
        return None
    except DFlashError as e:
        if "nested more than" in str(e):
            raise
        return None


def check_model_files(path: str | Path, what: str) -> None:
    """`check_model_dir`, then the counts and sizes of the directory's config.json."""
    check_model_dir(path, what)
    check_sizes(_config(Path(path), what), f"{what}: {Path(path) / 'config.json'}")


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_config_matches_weights(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """The config.json of a model directory describes the weights beside it: as many decoder
    layers (or fewer: some checkpoints add prediction layers) and the embedding's shape.

    transformers fills what the weights lack with freshly initialised tensors and says so in a
    log line: a config that lies (a hidden size of 10^7, 40 layers where the files hold 4)
    either allocates for as long as memory lasts or runs a model that is mostly random.
    """
    config = _config(path, "target.name_or_path")
    if not isinstance(config, dict) or not shapes:
        return
    text = config.get("text_config")
    text = text if isinstance(text, dict) else config
    where = f"{path / 'config.json'}"
    layers = {int(m.group(1)) for k in shapes if (m := _LAYER.search(k))}
    n = text.get("num_hidden_layers")
    if layers and isinstance(n, int) and n > max(layers) + 1:
        raise DFlashError(
            f"{where}: num_hidden_layers is {n:,}, the weights beside it hold {max(layers) + 1} "
            "layers; the config and the weights are of different models: fix or replace one"
        )
    embed = [v for k, v in shapes.items() if k.endswith("embed_tokens.weight") and len(v) == 2]
    hidden = text.get("hidden_size")
    if len(embed) == 1 and isinstance(hidden, int) and hidden != embed[0][1]:
        raise DFlashError(
            f"{where}: hidden_size is {hidden:,}, the weights' embedding is {list(embed[0])}; "
            "the config and the weights are of different models: fix or replace one"
        )
