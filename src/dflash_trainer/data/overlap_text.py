"""How text is normalised before it is compared with evaluation texts (decontamination).

Three views of one text, one per rule of `decontam.py`:

- `tokens`: the words of the 13-gram rule. Lower case, every run of characters that are not
  letters or digits (punctuation, `_`, whitespace) is a separator, and every run of *number
  tokens* becomes one token `#`. A number token is a decimal number (`42`), a `0x` hexadecimal
  literal, or a hexadecimal string of 6 or more characters that mixes digits and the letters
  a-f (hashes, colours, ids: `3f2a9b`). Why: a list of digits, a byte dump, a hash or a date
  is data that unrelated texts share (ShareGPT's `%w[0 1 2 ... 9 a b c ...]` shares 13 such
  "words" with HumanEval/78's list of hexadecimal digits); as one token it can no longer make
  up most of a 13-word match. A problem copied with its numbers changed still matches,
  since only the numbers differ.
- `shape_tokens`: the words of the near-duplicate rule: `tokens`, and also personal pronouns
  and names become placeholders. A name is a capitalised word that appears, capitalised, after
  a lower-case word, a number or a comma in the same text, so not at the start of a sentence;
  every occurrence of that word in the text is replaced ("Dora" in "Dora wants ... does Dora
  need" is a name, "How" is not). A copied word problem with its names,
  pronouns and numbers changed then has the shape of the original.
- `signatures`: the `def name(parameters)` headers of Python code, as (name, parameter
  names); annotations and defaults are not part of the key.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

NUMBER = "#"
# Placeholders for the near-duplicate rule: plain lower-case words, so they survive `tokens`.
PRONOUN = "zzpronoun"
NAME = "zzname"
_NON_WORD = re.compile(r"[\W_]+")
_NUM = r"(?:\d+|0x[0-9a-f]+|(?=[a-f]*\d)(?=\d*[a-f])[0-9a-f]{6,})"
# A run of number words in the space-separated lower-case text (whole words only).
_NUMBER_RUN = re.compile(rf"(?<!\S){_NUM}(?!\S)(?: {_NUM}(?!\S))*")
# A capitalised word right after a lower-case letter, a digit or a comma/semicolon/colon and
# one space: not the start of a sentence, so a name ("does Dora need", "and Max,").
_MID_CAPITAL = re.compile(r"(?<=[a-z0-9,;:] )[A-Z][a-z]+\b")
_PRONOUNS = dict.fromkeys(
    ("he", "she", "him", "her", "his", "hers", "himself", "herself"), PRONOUN
) | dict.fromkeys(("they", "them", "their", "theirs", "themselves"), PRONOUN)
_DEF = re.compile(r"\bdef\s+([A-Za-z_]\w*)\s*\(")
_PARAM_NAME = re.compile(r"\**\s*([A-Za-z_]\w*)")
_MAX_PARAMS_CHARS = 2000


def words(text: str) -> list[str]:
    """Lower case, split on every run of characters that are not letters or digits."""
    return _NON_WORD.sub(" ", text.lower()).split()


def tokens(text: str) -> list[str]:
    """The words the n-gram rule compares: `words`, every run of numbers one `#`."""
    return _NUMBER_RUN.sub(NUMBER, _NON_WORD.sub(" ", text.lower())).split()


def shape_tokens(text: str, ts: list[str] | None = None) -> list[str]:
    """`tokens` (pass them in when already made) with pronouns and names replaced."""
    if ts is None:
        ts = tokens(text)
    names = _MID_CAPITAL.findall(text)
    swap = _PRONOUNS | dict.fromkeys((n.lower() for n in names), NAME) if names else _PRONOUNS
    return [swap.get(w, w) for w in ts]


# ---------------------------------------------------------------- code signatures


def _split_params(text: str, start: int) -> list[str] | None:
    """The top-level comma-separated pieces between `(` (just before `start`) and its `)`."""
    depth = 0
    piece: list[str] = []
    pieces: list[str] = []
    end = min(len(text), start + _MAX_PARAMS_CHARS)
    for i in range(start, end):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                pieces.append("".join(piece))
                return pieces
            depth -= 1
        elif ch == "," and depth == 0:
            pieces.append("".join(piece))
            piece = []
            continue
        piece.append(ch)
    return None  # unclosed: not a header


def signatures(text: str) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(function name, parameter names) of every `def name(...)` header in `text`."""
    if "def" not in text:
        return
    for m in _DEF.finditer(text):
        pieces = _split_params(text, m.end())
        if pieces is None:
            continue
        names = []
        for piece in pieces:
            head = re.split(r"[:=]", piece, maxsplit=1)[0].strip()
            pm = _PARAM_NAME.fullmatch(head)
            if pm is not None:
                names.append(pm.group(1))
        yield m.group(1), tuple(names)


def name_words(name: str) -> list[str]:
    """`greatest_common_divisor` -> 3 words, `minSubArraySum` -> 4."""
    return [w for part in name.split("_") for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+", part)]


def format_signature(sig: tuple[str, tuple[str, ...]]) -> str:
    return f"def {sig[0]}({', '.join(sig[1])})"
