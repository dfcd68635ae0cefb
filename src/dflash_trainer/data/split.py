"""Train/eval split by a stable hash of the document id.

A document's split depends only on its id (the sha1 of its content) and the eval fraction: not
on file order, shard size, max_records or the machine. Re-preparing a grown dataset therefore
never moves an old eval document into train. The id is hashed again with a salt so that the
split is independent of any other use of the id's bits.
"""

from __future__ import annotations

import hashlib

_SALT = b"dflash-split-v1:"


def split_key(doc_id: str) -> float:
    """A uniform number in [0, 1) fixed by the id."""
    digest = hashlib.sha1(_SALT + doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(doc_id: str, eval_fraction: float) -> str:
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    return "eval" if split_key(doc_id) < eval_fraction else "train"
