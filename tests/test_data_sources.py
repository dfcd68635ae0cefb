"""The generic prompt-source reader, the mixture and `dflash data prompts` on constructed files."""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from dflash_trainer.cli import main
from dflash_trainer.config import ConfigError, SourceConfig
from dflash_trainer.data.decontam import build_index
from dflash_trainer.data.formats import read_records
from dflash_trainer.data.mixture import build_mixture, interleave, load_sources
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.sources import read_source, resolve_package_path
from dflash_trainer.errors import DFlashError


def _jsonl(path: Path, rows: list[Any]) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def _src(path: Path | str, name: str = "s", **kw: Any) -> SourceConfig:
    return SourceConfig(name=name, path=str(path), **kw)


def _contents(convs: list[Conversation]) -> list[list[tuple[str, str]]]:
    return [[(m["role"], m["content"]) for m in c.messages] for c in convs]


# ---------------------------------------------------------------- shapes


def test_prompt_field_ids_are_prefixed_and_skips_counted(tmp_path: Path) -> None:
    rows = [
        {"question": "What is up?", "id": 7},
        {"question": "Second?"},
        {"other": "no question here"},
        {"question": 3},
        {"question": "   "},
        {"question": "What is up?"},  # same content as the first
    ]
    convs, rep = read_source(_src(_jsonl(tmp_path / "q.jsonl", rows), "qa", prompt="question"))
    assert [c.id for c in convs] == ["qa/7", "qa/1"]
    assert _contents(convs) == [[("user", "What is up?")], [("user", "Second?")]]
    assert rep.records == 6 and rep.kept == 2
    assert rep.skipped == Counter(missing_field=1, bad_schema=1, empty_turn=1, duplicate=1)


def test_template_over_fields(tmp_path: Path) -> None:
    rows = [{"passage": "Ann has 3 apples.", "question": "How many?", "n": 2}, {"passage": "x"}]
    src = _src(_jsonl(tmp_path / "a.jsonl", rows), template="{passage}\n\n{question} ({n})")
    convs, rep = read_source(src)
    assert _contents(convs) == [[("user", "Ann has 3 apples.\n\nHow many? (2)")]]
    assert rep.skipped == Counter(missing_field=1)


@pytest.mark.parametrize("template", ["{passage.__class__}", "{0}", "{x!r}", "{x:>9}"])
def test_template_refuses_anything_but_plain_fields(tmp_path: Path, template: str) -> None:
    path = _jsonl(tmp_path / "a.jsonl", [{"x": "y"}])
    with pytest.raises(DFlashError, match="plain field names"):
        read_source(_src(path, template=template))


def test_messages_shapes(tmp_path: Path) -> None:
    chitchat = {
        "c1": {
            "messages": [
                [{"text": "Hello", "sender": "a"}, {"text": "How are you?", "sender": "a"}],
                [{"text": "Fine", "sender": "b"}],
                [{"text": "Good", "sender": "a"}],
            ],
            "prompt": "seed topic",
        },
        "c2": {"messages": [[{"text": "Alone", "sender": "z"}]]},
    }
    (tmp_path / "chat.json").write_text(json.dumps(chitchat))
    convs, _ = read_source(_src(tmp_path / "chat.json", "cc", messages="messages"))
    assert [c.id for c in convs] == ["cc/c1", "cc/c2"]
    assert _contents(convs) == [
        [("user", "Hello\nHow are you?"), ("assistant", "Fine"), ("user", "Good")],
        [("user", "Alone")],
    ]
    rows = [
        {"m": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]},
        {"m": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]},
        {"m": ["q3", "a3", "q4"]},
        {"m": [{"role": "tool", "content": "x"}]},
        {"m": "not a list"},
    ]
    convs, rep = read_source(_src(_jsonl(tmp_path / "m.jsonl", rows), messages="m"))
    assert _contents(convs) == [
        [("user", "q1"), ("assistant", "a1")],
        [("user", "q2"), ("assistant", "a2")],
        [("user", "q3"), ("assistant", "a3"), ("user", "q4")],
    ]
    assert rep.skipped == Counter(unknown_role=1, bad_schema=1)


def test_one_json_array_in_a_jsonl_gz_and_jsonl_in_a_jsonl_gz(tmp_path: Path) -> None:
    rows = [{"t": f"task {i}", "c": f"def f{i}(): pass"} for i in range(3)]
    array = tmp_path / "array.jsonl.gz"
    array.write_bytes(gzip.compress(json.dumps(rows, indent=4).encode()))
    lines = _jsonl(tmp_path / "lines.jsonl.gz", rows)
    for path in (array, lines):
        convs, rep = read_source(_src(path, template="{t}\n{c}"))
        assert [c.messages[0]["content"] for c in convs] == [
            f"task {i}\ndef f{i}(): pass" for i in range(3)
        ]
        assert (rep.records, rep.kept) == (3, 3)


def test_no_mapping_uses_the_record_formats(tmp_path: Path) -> None:
    rows = [
        {
            "id": "x",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
        },
        {"prompt": "only a prompt"},
        {"neither": 1},
    ]
    convs, rep = read_source(_src(_jsonl(tmp_path / "sg.jsonl", rows), "sg"))
    assert [c.id for c in convs] == ["sg/x", "sg/sg.jsonl:1"]
    assert (rep.records, rep.kept, dict(rep.skipped)) == (3, 2, {"bad_schema": 1})


# ---------------------------------------------------------------- paths


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed-looking package (a directory on sys.path) whose code must never run."""
    root = tmp_path / "site"
    pkg = root / "dflash_fake_corpus"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('package code must not be imported')\n")
    _jsonl(pkg / "data" / "q.jsonl", [{"question": "inside the package"}])
    (tmp_path / "secret.jsonl").write_text('{"question": "outside"}\n')
    monkeypatch.syspath_prepend(str(root))
    return pkg


def test_pkg_path_resolves_inside_the_package_without_importing_it(fake_package: Path) -> None:
    convs, _ = read_source(_src("pkg:dflash_fake_corpus/data/q.jsonl", prompt="question"))
    assert _contents(convs) == [[("user", "inside the package")]]
    assert "dflash_fake_corpus" not in sys.modules


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("pkg:dflash_fake_corpus/../secret.jsonl", "outside the package directory"),
        ("pkg:dflash_fake_corpus/data/../../secret.jsonl", "outside the package directory"),
        ("pkg:dflash_fake_corpus/link.jsonl", "outside the package directory"),
        ("pkg:dflash_fake_corpus//etc/passwd", "must be relative"),
        ("pkg:os.path/x.json", "top-level package name"),
        ("pkg:dflash_fake_corpus", "top-level package name"),
        ("pkg:dflash_fake_corpus/data/none.jsonl", "no file 'data/none.jsonl'"),
        ("pkg:dflash_no_such_package/x.json", "is not installed"),
    ],
)
def test_pkg_path_refusals(fake_package: Path, spec: str, message: str) -> None:
    (fake_package / "link.jsonl").symlink_to(fake_package.parent.parent / "secret.jsonl")
    with pytest.raises(DFlashError, match=message):
        resolve_package_path(spec)


# ---------------------------------------------------------------- bad input


def test_missing_file_and_unknown_type(tmp_path: Path) -> None:
    with pytest.raises(DFlashError, match=r"nope\.jsonl does not exist"):
        read_source(_src(tmp_path / "nope.jsonl", prompt="q"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DFlashError, match="unknown file type"):
        read_source(_src(tmp_path / "x.csv", prompt="q"))


def test_truncated_gzip_at_any_offset_is_a_clear_error(tmp_path: Path) -> None:
    rows = [{"q": f"question number {i} " * 5} for i in range(200)]
    whole = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())
    for cut in (1, 5, 10, 11, len(whole) // 3, len(whole) // 2, len(whole) - 8, len(whole) - 1):
        path = tmp_path / f"cut{cut}.jsonl.gz"
        path.write_bytes(whole[:cut])
        with pytest.raises(DFlashError, match=rf"cut{cut}\.jsonl\.gz: truncated or damaged gzip"):
            read_source(_src(path, prompt="q"))
    damaged = bytearray(whole)
    damaged[len(whole) // 2] ^= 0xFF
    (tmp_path / "flip.jsonl.gz").write_bytes(bytes(damaged))
    with pytest.raises(DFlashError, match="truncated or damaged gzip"):
        read_source(_src(tmp_path / "flip.jsonl.gz", prompt="q"))


def test_non_utf8_bytes_skip_only_their_record(tmp_path: Path) -> None:
    good = b'{"q": "fine"}\n'
    bad = b'{"q": "caf\xe9 latin-1"}\n'
    unused = b'{"q": "ok too", "other": "\xff\xfe"}\n'
    (tmp_path / "l.jsonl").write_bytes(good + bad + unused + b'{"q": "lone \\udc80"}\n')
    convs, rep = read_source(_src(tmp_path / "l.jsonl", prompt="q"))
    assert _contents(convs) == [[("user", "fine")], [("user", "ok too")]]
    assert rep.skipped == Counter(bad_utf8=2)
    (tmp_path / "a.json").write_bytes(b'[{"q": "fine"}, {"q": "caf\xe9"}]')
    convs, rep = read_source(_src(tmp_path / "a.json", prompt="q"))
    assert (rep.kept, dict(rep.skipped)) == (1, {"bad_utf8": 1})


def test_wrong_shapes(tmp_path: Path) -> None:
    (tmp_path / "scalar.json").write_text("42")
    with pytest.raises(DFlashError, match=r"scalar\.json: wrong shape.*got a top-level int"):
        read_source(_src(tmp_path / "scalar.json", prompt="q"))
    path = _jsonl(tmp_path / "w.jsonl", [{"question": "a"}, {"question": "b"}])
    with pytest.raises(
        DFlashError, match=r"w\.jsonl.*none of 2 records matched prompt: 'questoin'.*\['question'\]"
    ):
        read_source(_src(path, prompt="questoin"))
    (tmp_path / "broken.json").write_text('[{"q": "one"}, {"q": "tw')
    _, rep = read_source(_src(tmp_path / "broken.json", prompt="q"))
    assert (rep.kept, dict(rep.skipped)) == (1, {"bad_json": 1})
    (tmp_path / "bad.jsonl").write_text('{"q": "one"}\n{"q": \n')
    _, rep = read_source(_src(tmp_path / "bad.jsonl", prompt="q"))
    assert (rep.kept, dict(rep.skipped)) == (1, {"bad_json": 1})


# ---------------------------------------------------------------- config and mixture


def test_source_config_validation() -> None:
    with pytest.raises(ConfigError, match=r"data\.sources\.x\.template: give one of"):
        SourceConfig(name="x", path="p.jsonl", prompt="q", template="{q}")
    with pytest.raises(ConfigError, match=r"data\.sources\.a/b\.name"):
        SourceConfig(name="a/b", path="p.jsonl")
    with pytest.raises(ConfigError, match=r"data\.sources\.x\.weight: must be in \(0, "):
        SourceConfig(name="x", path="p.jsonl", weight=0)
    with pytest.raises(ConfigError, match=r"data\.sources\.x\.cap: must be in \[1, "):
        SourceConfig(name="x", path="p.jsonl", cap=0)


def test_load_sources_from_snippet_or_config(tmp_path: Path) -> None:
    (tmp_path / "mix.yaml").write_text("sources:\n  - {name: a, path: a.jsonl, prompt: q}\n")
    assert load_sources(tmp_path / "mix.yaml")[0].prompt == "q"
    (tmp_path / "cfg.yaml").write_text(
        "data:\n  sources:\n    - {name: a, path: a.jsonl, cap: 3}\n"
    )
    assert load_sources(tmp_path / "cfg.yaml")[0].cap == 3
    (tmp_path / "typo.yaml").write_text("sources:\n  - {name: a, path: a.jsonl, promt: q}\n")
    with pytest.raises(DFlashError, match=r"data\.sources\[0\]\.promt: unknown key"):
        load_sources(tmp_path / "typo.yaml")
    (tmp_path / "dup.yaml").write_text("sources:\n  - {name: a, path: x}\n  - {name: a, path: y}\n")
    with pytest.raises(DFlashError, match=r"unique.*\['a'\]"):
        load_sources(tmp_path / "dup.yaml")
    with pytest.raises(DFlashError, match=r"shipped: .*smollm2-mix"):
        load_sources("no-such-mixture")
    shipped = load_sources("smollm2-mix")
    assert [s.name for s in shipped][:2] == ["sharegpt", "chitchat"]


def test_interleave_keeps_weighted_proportions_in_every_prefix() -> None:
    a = [Conversation(f"a/{i}", []) for i in range(100)]
    b = [Conversation(f"b/{i}", []) for i in range(10)]
    out = [c.id[0] for c in interleave([a, b], [3.0, 1.0])]
    assert len(out) == 110
    for k in range(4, 40):  # while both last, each prefix is 3:1 within one record
        assert abs(out[:k].count("a") - 3 * out[:k].count("b")) <= 3
    assert out[-60:] == ["a"] * 60  # b ran out, a continues: weights never drop records


def test_mixture_caps_dedupes_across_sources_and_decontaminates(tmp_path: Path) -> None:
    leak = "one two three four five six seven eight nine ten eleven twelve thirteen"
    (tmp_path / "eval.jsonl").write_text(
        json.dumps({"id": "e1", "text": f"intro {leak} outro"}) + "\n"
    )
    a = _jsonl(
        tmp_path / "a.jsonl", [{"q": f"alpha {i}"} for i in range(20)] + [{"q": f"x {leak}"}]
    )
    b = _jsonl(tmp_path / "b.jsonl", [{"q": "alpha 3"}, {"q": "beta"}])
    sources = [_src(a, "a", prompt="q", cap=5, weight=2.0), _src(b, "b", prompt="q")]
    index = build_index([], [tmp_path / "eval.jsonl"])
    mix = build_mixture(sources, index, seed=0)
    ra, rb = mix.reports
    assert (ra.records, ra.kept, ra.decontaminated, ra.over_cap, ra.written) == (21, 21, 1, 15, 5)
    assert (rb.records, rb.kept, rb.written, dict(rb.skipped)) == (2, 1, 1, {"duplicate": 1})
    assert mix.dropped == [
        {
            "id": "a/20",
            "source": "a",
            "rule": "ngram",
            "eval": "eval.jsonl/e1",
            "match": leak,
            "also": ["near_duplicate"],
        }
    ]
    assert ra.decontaminated_by == {"ngram": 1}
    assert [c.id.split("/")[0] for c in mix.conversations] == ["a", "a", "b", "a", "a", "a"]
    again = build_mixture(sources, index, seed=0)
    assert [c.id for c in again.conversations] == [c.id for c in mix.conversations]
    other = build_mixture(sources, index, seed=1)
    assert {c.id for c in other.conversations} != {c.id for c in mix.conversations}


# ---------------------------------------------------------------- CLI


def _mix_yaml(tmp_path: Path, second: str) -> Path:
    _jsonl(tmp_path / "a.jsonl", [{"passage": f"P{i}.", "question": f"Q{i}?"} for i in range(6)])
    (tmp_path / "mix.yaml").write_text(
        "sources:\n"
        f"  - {{name: a, path: {tmp_path / 'a.jsonl'}, template: '{{passage}} {{question}}'}}\n"
        f"  - {{name: b, path: {second}, prompt: q, cap: 1}}\n"
    )
    return tmp_path / "mix.yaml"


def test_prompts_cli_writes_a_file_regenerate_reads(tmp_path: Path, capsys: Any) -> None:
    _jsonl(tmp_path / "b.jsonl", [{"q": "b0"}, {"q": "b1"}, {"x": 1}])
    out = tmp_path / "out" / "prompts.jsonl"
    argv = ["data", "prompts", "--sources", str(_mix_yaml(tmp_path, str(tmp_path / "b.jsonl")))]
    assert main([*argv, "--out", str(out), "--decontam-evals", "none"]) == 0
    text = capsys.readouterr().out
    assert "written: 7 conversations" in text and "missing_field 1" in text
    records = list(read_records(out, require_assistant=False))
    assert len(records) == 7 and {r.id.split("/")[0] for r in records} == {"a", "b"}
    counts = json.loads((tmp_path / "out" / "prompts.jsonl.sources.json").read_text())
    assert [(s["name"], s["records"], s["written"]) for s in counts["sources"]] == [
        ("a", 6, 6),
        ("b", 3, 1),
    ]
    assert (tmp_path / "out" / "prompts.jsonl.decontam.jsonl").read_text() == ""
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "prompts.jsonl",
        "prompts.jsonl.decontam.jsonl",
        "prompts.jsonl.sources.json",
    ]
    assert main(["data", "stats", str(out)]) == 0
    assert "decontamination: off" in capsys.readouterr().out


def test_prompts_cli_failure_leaves_nothing(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"q": "x"}\n' * 50)[:-6])
    out = tmp_path / "out" / "prompts.jsonl"
    argv = ["data", "prompts", "--sources", str(_mix_yaml(tmp_path, str(tmp_path / "b.jsonl.gz")))]
    assert main([*argv, "--out", str(out), "--decontam-evals", "none"]) == 2
    assert "b.jsonl.gz: truncated or damaged gzip" in capsys.readouterr().err
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_prepare_counts_documents_and_tokens_per_source(tmp_path: Path, capsys: Any) -> None:
    from test_data_support import tiny_tokenizer

    from dflash_trainer.data.prepare import prepare_dataset

    def chat(i: int, word: str) -> dict[str, Any]:
        return {"m": [f"{word} question {i}?", f"{word} answer {i} " * (i + 1)]}

    a = _jsonl(tmp_path / "a.jsonl", [chat(i, "alpha") for i in range(6)])
    b = _jsonl(tmp_path / "b.jsonl", [chat(i, "beta") for i in range(3)] + [{"m": ["no answer"]}])
    (tmp_path / "mix.yaml").write_text(
        f"sources:\n  - {{name: a, path: {a}, messages: m}}\n  - {{name: b, path: {b}, messages: m}}\n"
    )
    out = tmp_path / "prompts.jsonl"
    argv = ["data", "prompts", "--sources", str(tmp_path / "mix.yaml"), "--out", str(out)]
    assert main([*argv, "--decontam-evals", "none"]) == 0
    ds = prepare_dataset(out, tiny_tokenizer(), tmp_path / "prep", eval_fraction=0.0)
    manifest = json.loads((ds / "manifest.json").read_text())
    per = manifest["sources"]
    assert {k: v["documents"] for k, v in per.items()} == {"a": 6, "b": 3}
    train = manifest["splits"]["train"]
    assert sum(v["tokens"] for v in per.values()) == train["tokens"]
    assert sum(v["supervised_tokens"] for v in per.values()) == train["supervised_tokens"]
    assert per["a"]["tokens"] > per["b"]["tokens"] > 0
    # The prompt-only record is skipped by prepare's reader (before ids are known to the tally)
    # but the mixture's own counts travel with the file into the manifest.
    assert [s["written"] for s in manifest["source_mixture"]["sources"]] == [6, 4]
    capsys.readouterr()
    assert main(["data", "stats", str(ds)]) == 0
    text = capsys.readouterr().out
    assert "per source (prepared documents)" in text and "per source (read by" in text


def test_no_mapping_source_in_a_package_and_a_missing_plain_path(fake_package: Path) -> None:
    _jsonl(
        fake_package / "data" / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]
    )
    convs, _ = read_source(_src("pkg:dflash_fake_corpus/data/chats.jsonl", "p"))
    assert [c.id for c in convs] == ["p/chats.jsonl:0"]
    with pytest.raises(DFlashError, match="source file nowhere does not exist"):
        read_source(_src("nowhere", prompt="q"))
