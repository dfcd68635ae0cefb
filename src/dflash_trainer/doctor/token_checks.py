"""The doctor's checks of drafter.mask_token_id: inside the vocab, not a stop or padding
token, a special (or unused) token of the tokenizer, and absent from the training data.

A mask id that occurs in the data makes a masked slot indistinguishable from a real
token; one that is EOS or PAD ends generation or is ignored when it is drafted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from dflash_trainer.config import Config
from dflash_trainer.doctor.report import Check


def stop_and_pad_ids(t: Any, generation_config: dict[str, Any] | None) -> dict[int, str]:
    out: dict[int, str] = {}
    for src in [t, generation_config or {}]:
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = src.get(key) if isinstance(src, dict) else getattr(src, key, None)
            for i in value if isinstance(value, list) else [value]:
                if i is not None:
                    out.setdefault(int(i), key)
    return out


def check_mask_token(
    cfg: Config,
    t: Any,
    generation_config: dict[str, Any] | None,
    tokenizer: Any | None,
    occurrences: tuple[int, int, str] | None,
) -> list[Check]:
    """`occurrences`: (count, tokens scanned, first document id) from the data, or None."""
    m = cfg.drafter.mask_token_id
    vocab = int(t.vocab_size)
    if m is None:
        return [
            Check(
                "mask.set",
                "fail",
                "drafter.mask_token_id is not set",
                "pick an id that never occurs in the data and is not EOS/PAD "
                "(Qwen3: 151669, Qwen3.5/3.6: 248070, SmolLM2: 16)",
            )
        ]
    if not 0 <= m < vocab:
        return [
            Check(
                "mask.vocab",
                "fail",
                f"drafter.mask_token_id={m} is outside the vocab 0..{vocab - 1}",
                "use an id inside the target's embedding table",
            )
        ]
    return [
        Check("mask.vocab", "pass", f"drafter.mask_token_id={m} inside the vocab (0..{vocab - 1})"),
        _special_ids(m, stop_and_pad_ids(t, generation_config)),
        _tokenizer_check(m, tokenizer),
        _data_check(m, occurrences),
    ]


def _special_ids(m: int, special: dict[int, str]) -> Check:
    if m in special:
        return Check(
            "mask.special",
            "fail",
            f"drafter.mask_token_id={m} is the target's {special[m]}: a drafted mask would "
            "end generation or be ignored as padding",
            "use a token that is neither EOS, PAD nor BOS",
        )
    return Check("mask.special", "pass", f"not EOS/PAD/BOS ({sorted(special) or 'none set'})")


def _tokenizer_check(m: int, tokenizer: Any | None) -> Check:
    """An unused embedding row or a special token is safe; an ordinary word may occur."""
    if tokenizer is None:
        return Check("mask.tokenizer", "skip", "no local tokenizer: special-token check skipped")
    n_tok = len(tokenizer)
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    specials |= {
        i
        for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(tok, "special", False)
    }
    if m >= n_tok:
        return Check(
            "mask.tokenizer",
            "pass",
            f"id {m} is an unused embedding row (tokenizer has {n_tok})",
        )
    name = tokenizer.convert_ids_to_tokens(m)
    if m in specials:
        return Check("mask.tokenizer", "pass", f"id {m} is the special token {name!r}")
    return Check(
        "mask.tokenizer",
        "warn",
        f"drafter.mask_token_id={m} is the ordinary token {name!r}: it may occur in real text",
        "prefer a special token never used in chat or an unused embedding row",
    )


def _data_check(m: int, occurrences: tuple[int, int, str] | None) -> Check:
    if occurrences is None:
        return Check(
            "mask.data", "skip", "no data given: occurrence check skipped", "pass --data DIR"
        )
    count, scanned, first = occurrences
    if count:
        return Check(
            "mask.data",
            "fail",
            f"drafter.mask_token_id={m} occurs {count} times in {scanned:,} scanned tokens of "
            f"the training data (first in document {first}): the drafter could not tell a "
            "masked slot from a real token",
            "choose a mask id that never occurs in the data",
        )
    return Check("mask.data", "pass", f"id {m} absent from {scanned:,} scanned data tokens")


def scan_tokens(
    docs: Iterable[Sequence[int] | Any], token: int, doc_ids: Iterable[str]
) -> tuple[int, int, str]:
    """(occurrences of `token`, tokens scanned, first document id containing it)."""
    import numpy as np

    count = scanned = 0
    first = ""
    for ids, doc_id in zip(docs, doc_ids):
        arr = np.asarray(ids)
        hits = int((arr == token).sum())
        if hits and not first:
            first = doc_id
        count += hits
        scanned += int(arr.size)
    return count, scanned, first
