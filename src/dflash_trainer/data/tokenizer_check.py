"""Prepared data belongs to the target it trains against: same tokenizer, ids inside its vocab.

A prepared directory's manifest records the tokenizer that made it (`tokenizer`: name, vocab
size, `vocab_sha256` of its serialisation and, since this check exists, `vocab_ids_sha256` of
its token -> id map, which does not change with the tokenizers library's version) and each
split's smallest and largest token id (`token_ids`). `dflash train`, `dflash doctor` and
`dflash plan` compare them with the target:

- another tokenizer (the vocabularies' hashes differ, or their sizes) -> refused, naming both;
- a token id outside the target's vocabulary (its embedding rows) -> refused: the target would
  index past its embedding table (a crash, or on a GPU a device assert);
- a directory without the record (an older version, or made by hand) -> a warning, not a
  refusal; its ids are still checked (read from its shards when the manifest has no range).

`findings` returns them as (status, message, fix) with status "pass", "warn" or "fail"; the
doctor shows them as checks, train and plan raise on a fail (`refuse_mismatch`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from dflash_trainer.errors import DFlashError

Finding = tuple[Literal["pass", "warn", "fail"], str, str]


def serialized_sha256(tokenizer: Any) -> str:
    """sha256 of the tokenizer's serialisation (its fast backend's JSON, else its vocab)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab())
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def vocab_ids_sha256(tokenizer: Any) -> str:
    """sha256 of the token -> id map, in id order (the same for any library version)."""
    pairs = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode("utf-8")).hexdigest()


def _describe(name: Any, size: Any, digest: Any) -> str:
    return f"{name} ({size} tokens, vocabulary sha256 {str(digest)[:12]}...)"


def _tokenizer_finding(record: dict[str, Any], tokenizer: Any, target: str) -> Finding:
    """The recorded tokenizer against the target's (loaded)."""
    name, size = record.get("name", "?"), record.get("vocab_size")
    fix = f"prepare the data again with the target's tokenizer (--tokenizer {target})"
    mine_size = len(tokenizer)
    if record.get("vocab_ids_sha256"):
        theirs, mine = record["vocab_ids_sha256"], vocab_ids_sha256(tokenizer)
    else:  # recorded before vocab_ids_sha256: the serialisation's hash
        theirs, mine = record.get("vocab_sha256"), serialized_sha256(tokenizer)
        if theirs != mine and size == mine_size:
            return (
                "warn",
                f"prepared with {name}, whose serialisation differs from the target's "
                f"tokenizer {target} at the same size ({size} tokens); a tokenizers library "
                "upgrade can do that, another tokenizer too: not confirmed",
                fix + " to be sure",
            )
    if theirs == mine and size in (None, mine_size):
        return "pass", f"prepared with the target's tokenizer ({name}, {mine_size} tokens)", ""
    return (
        "fail",
        f"prepared with another tokenizer: {_describe(name, size, theirs)}; the target's is "
        f"{_describe(target, mine_size, mine)}",
        fix,
    )


def token_id_range(manifest: dict[str, Any], root: Path, split: str, scan: bool) -> Any:
    """(min, max) token id of a split: the manifest's record, else (scan) read from its
    shards; None when unknown."""
    rec = manifest.get("splits", {}).get(split, {}).get("token_ids")
    if isinstance(rec, list) and len(rec) == 2 and all(isinstance(x, int) for x in rec):
        return tuple(rec)
    if not scan:
        return None
    from dflash_trainer.data.shards import PreparedDataset

    return PreparedDataset(root, split).token_id_range()


def findings(
    root: Path,
    manifest: dict[str, Any],
    target: str,
    target_vocab: int,
    tokenizer: Any | None,
    scan: bool = True,
) -> list[Finding]:
    """What `root`'s recorded tokenizer and token ids say against the target's."""
    out: list[Finding] = []
    record = manifest.get("tokenizer")
    if not isinstance(record, dict) or not record:
        out.append((
            "warn",
            f"{root} records no tokenizer (prepared by an older version or by hand): it cannot "
            "be checked against the target's; only its token ids are",
            "prepare it again with `dflash data prepare` to record its tokenizer",
        ))  # fmt: skip
    elif tokenizer is not None:
        out.append(_tokenizer_finding(record, tokenizer, target))
    for split in ("train", "eval"):
        if split not in manifest.get("splits", {}):
            continue
        rng = token_id_range(manifest, root, split, scan)
        if rng is None or rng == (0, -1):  # unknown, or an empty split
            continue
        lo, hi = rng
        if lo < 0 or hi >= target_vocab:
            out.append((
                "fail",
                f"{root} ({split}) holds token ids {lo}..{hi}, outside the target's vocabulary "
                f"of {target_vocab} (ids 0..{target_vocab - 1}): it was prepared for another "
                "model",
                f"prepare the data again with the target's tokenizer (--tokenizer {target})",
            ))  # fmt: skip
    return out


def refuse_mismatch(found: list[Finding], warn: Callable[[str], None]) -> None:
    """Raise on the first fail (train, plan); say the warnings."""
    for status, message, fix in found:
        if status == "fail":
            raise DFlashError(f"{message}; {fix}")
        if status == "warn":
            warn(f"{message} ({fix})")


def load_target_tokenizer(target_cfg: Any, warn: Callable[[str], None] | None = None) -> Any:
    """The target's tokenizer, or None (said through `warn`) when it cannot be loaded here."""
    from dflash_trainer.data.loading import load_tokenizer, tokenizer_spec

    try:
        return load_tokenizer(tokenizer_spec(target_cfg), target_cfg.trust_remote_code)
    except (DFlashError, OSError, ValueError) as e:
        if warn is not None:
            warn(f"the target's tokenizer did not load ({str(e)[:200]}); the prepared data's "
                 "tokenizer is not compared, only its token ids")  # fmt: skip
        return None


def check_train_data(data: Any, target_cfg: Any, target_vocab: int, warn: Callable) -> None:
    """The trainer's check of its prepared data (`TrainData`) against the loaded target."""
    manifest = getattr(data.train, "manifest", None)
    if not isinstance(manifest, dict) or data.path is None:
        return  # documents handed over in code, not a prepared directory
    tokenizer = None
    if isinstance(manifest.get("tokenizer"), dict) and manifest["tokenizer"]:
        tokenizer = load_target_tokenizer(target_cfg, warn)
    found = findings(Path(data.path), manifest, target_cfg.name_or_path, target_vocab, tokenizer)
    refuse_mismatch(found, warn)
