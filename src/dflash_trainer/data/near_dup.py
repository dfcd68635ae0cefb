"""Near-duplicates of evaluation texts: word-shingle containment after names and numbers go.

A copied word problem with its names, pronouns, numbers and a few nouns changed ("Ulrich wants
to buy a jump rope that costs $9 ..." for GSM8K's "Dora wants to buy a skipping rope that costs
$6 ...") need not share 13 words in a row with the original, but once `shape_tokens` has
replaced the names, pronouns and numbers, most of the original's 4-word shingles are there. The score is the
containment of the eval text in the training text: shared shingles / the eval text's shingles
(containment, not Jaccard, so that a problem pasted inside a longer prompt still counts).

Measured on the `smollm2-mix` sources against GSM8K test, HumanEval and MT-Bench (docs/data.md):
the two known near-copies score 1.00 (asdiv/663 ~ gsm8k/632) and 0.76 (asdiv/657 ~
gsm8k/431). The highest other score is 0.46 (codeio/2628, a longest-common-subsequence
implementation like the one MT-Bench 124 asks about; the n-gram rule drops it), then 0.30
(a regex matcher sharing that code's loop headers) and 0.29 (an ASDiv problem with a GSM8K
problem's "mother gave ... how much money does X have left" frame around other items). Hence
the default threshold 0.6, in the middle of the gap, and at least 10 shared shingles, so an
eval text shorter than 13 words never matches this way (it carries too little to tell a copy
from a common question).

Speed: an inverted index from shingle to eval texts. A training text costs one set lookup per
word (is the word in the eval vocabulary?) and a dict lookup only where the last 4 words all
are; shingles found in more than `MAX_EVAL_TEXTS_PER_SHINGLE` eval texts are stock phrases
("how many # does") and are left out of the index and of the eval text's size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dflash_trainer.data.overlap_text import shape_tokens
from dflash_trainer.errors import DFlashError

SHINGLE = 4
DEFAULT_CONTAINMENT = 0.6
MIN_SHARED = 10
MAX_EVAL_TEXTS_PER_SHINGLE = 50

Shingle = tuple[str, ...]


@dataclass(frozen=True)
class NearHit:
    eval_id: str
    containment: float
    shared: int
    size: int


def shingles(ts: list[str], k: int = SHINGLE) -> set[Shingle]:
    return {tuple(ts[i : i + k]) for i in range(len(ts) - k + 1)}


class NearDupIndex:
    """Shingles of eval texts -> the texts that hold them; `add` all texts, then `freeze`."""

    def __init__(self, threshold: float = DEFAULT_CONTAINMENT, min_shared: int = MIN_SHARED):
        if not 0.0 < threshold <= 1.0:
            raise DFlashError(f"near-duplicate containment {threshold}: use a value in (0, 1]")
        self.threshold, self.min_shared = threshold, min_shared
        self._texts: list[tuple[str, set[Shingle]]] = []
        self._postings: dict[Shingle, list[int]] = {}
        self._sizes: list[int] = []
        self._ids: list[str] = []
        self._vocab: set[str] = set()
        self._frozen = False

    def __len__(self) -> int:
        """Eval texts that can be matched (long enough to share `min_shared` shingles)."""
        return sum(1 for s in self._sizes if s >= self.min_shared)

    def add_text(self, eval_id: str, text: str) -> None:
        if self._frozen:
            raise RuntimeError("NearDupIndex.add_text after freeze")
        grams = shingles(shape_tokens(text))
        if len(grams) >= self.min_shared:
            self._texts.append((eval_id, grams))

    def freeze(self) -> None:
        """Build the postings, leaving out stock shingles (see the module docstring)."""
        if self._frozen:
            return
        df: Counter[Shingle] = Counter()
        for _, grams in self._texts:
            df.update(grams)
        for eval_id, grams in self._texts:
            kept = [g for g in grams if df[g] <= MAX_EVAL_TEXTS_PER_SHINGLE]
            if len(kept) < self.min_shared:
                continue
            n = len(self._ids)
            self._ids.append(eval_id)
            self._sizes.append(len(kept))
            for g in kept:
                self._postings.setdefault(g, []).append(n)
                self._vocab.update(g)
        self._texts = []
        self._frozen = True

    def find(self, text: str, ts: list[str] | None = None) -> NearHit | None:
        """The eval text most contained in `text` (whose `tokens` are `ts`, when already made),
        if at or above the threshold."""
        self.freeze()
        ts = shape_tokens(text, ts)
        vocab, postings, k = self._vocab, self._postings, SHINGLE
        seen: set[Shingle] = set()
        counts: Counter[int] = Counter()
        run = 0
        for i, w in enumerate(ts):
            run = run + 1 if w in vocab else 0
            if run < k:
                continue
            g = tuple(ts[i - k + 1 : i + 1])
            hit = postings.get(g)
            if hit is not None and g not in seen:
                seen.add(g)
                counts.update(hit)
        best: NearHit | None = None
        for n, shared in counts.items():
            size = self._sizes[n]
            score = shared / size
            ok = shared >= self.min_shared and score >= self.threshold
            if ok and (best is None or score > best.containment):
                best = NearHit(self._ids[n], score, shared, size)
        return best
