"""Token ids of chat renders that grow turn by turn, without re-tokenizing the whole history.

Why: regenerating every turn of a conversation renders and tokenizes the conversation so far
once per turn (the next prompt, the budget check). Tokenizing a few thousand tokens takes
milliseconds of host time, and it sits inside the engine's loop: with a thousand rows and
several turns ending per decode step, the host, not the GPU, sets the pace.

How: a fast tokenizer first cuts its input at the text of its added tokens (`<|im_start|>`,
`<|im_end|>`, ...) and tokenizes the pieces between them independently. A chat render is
mostly pieces seen before (earlier turns, role headers), so the ids of each piece are kept
and only new pieces (the latest answer and user message) are tokenized.

Exactness is checked, not assumed: the first calls and every `check_every`-th call after them
are compared with a full tokenization; a tokenizer for which pieces do not compose (an added
token that strips neighbouring spaces, a normalizer that rewrites across pieces, a prefix
space given only to the first piece of a text) is caught there, and the cache is switched off
for the rest of the job with a one-line notice. Every answer is then the full tokenization's.
"""

from __future__ import annotations

import re
import sys
from array import array
from typing import Any

_MAX_PIECES = 200_000  # cached pieces before the cache starts over (memory, not speed)
# Ids are kept as 4-byte arrays: a Python list of ints costs 36 bytes a token, and the cache
# holds every turn of the conversations in flight.


class SegmentTokenizer:
    """`ids(text)`: `tokenizer(text, add_special_tokens=False)["input_ids"]`, piece-cached."""

    def __init__(self, tokenizer: Any, check_first: int = 64, check_every: int = 64) -> None:
        self.tokenizer = tokenizer
        self.check_first, self.check_every = check_first, check_every
        self.calls = 0
        self.mismatches = 0
        self.cache: dict[tuple[bool, str], array[int]] = {}
        added = dict(getattr(tokenizer, "added_tokens_encoder", {}) or {})
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        strips = any(
            getattr(t, "lstrip", False)
            or getattr(t, "rstrip", False)
            or getattr(t, "single_word", False)
            for t in decoder.values()
        )
        self.enabled = bool(added) and backend is not None and not strips
        self.added = added
        self.backend = backend
        names = sorted(
            added, key=len, reverse=True
        )  # the longest match wins, as the tokenizer does
        self.split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def _full(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _pieces(self, text: str) -> list[int]:
        assert self.split is not None and self.backend is not None
        out: list[int] = []
        for i, part in enumerate(self.split.split(text)):
            if i % 2:  # the captured added token
                out.append(self.added[part])
            elif part:
                key = (i == 0, part)
                ids = self.cache.get(key)
                if ids is None:
                    ids = array("i", self.backend.encode(part, add_special_tokens=False).ids)
                    if len(self.cache) >= _MAX_PIECES:
                        self.cache.clear()
                    self.cache[key] = ids
                out.extend(ids)
        return out

    def __call__(self, text: str) -> list[int]:
        if not self.enabled:
            return self._full(text)
        self.calls += 1
        ids = self._pieces(text)
        if self.calls <= self.check_first or self.calls % self.check_every == 0:
            full = self._full(text)
            if full != ids:
                self.mismatches += 1
                self.enabled = False
                self.cache.clear()
                print(
                    "dflash: this tokenizer does not tokenize chat renders piece by piece "
                    "exactly; every prompt is tokenized whole (slower host bookkeeping)",
                    file=sys.stderr,
                )
                return full
        return ids
