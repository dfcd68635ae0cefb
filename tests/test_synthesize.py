"""`dflash data synthesize`: target-written prompts, filtered, de-duplicated, resumable.

The model is a real tiny Llama built in code with random weights, so most of what it writes is
garbage: that exercises the filters. An output bias keeps byte-fragment tokens unlikely, so
some prompts survive and the kept path is exercised too. The de-duplication gets constructed
inputs, since random text is almost never a near duplicate.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_data_support import tiny_llama, tiny_tokenizer

from dflash_trainer.data.formats import read_records
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.synthesize import (
    Deduper,
    SynthSettings,
    filter_reason,
    synthesize,
    user_turn_prefix,
)
from dflash_trainer.data.template import ChatTemplate
from dflash_trainer.errors import DFlashError

pytestmark = pytest.mark.usefixtures("one_thread")
TESTS = Path(__file__).parent


def writer_model(tok: Any) -> Any:
    """A random tiny Llama whose head favours whole-word tokens and ends turns often."""
    m = tiny_llama(len(tok), seed=1, eos_token_id=[2, *range(300, 316)])
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(m.config.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.3)
        for i in range(len(tok)):
            piece = tok.decode([i])
            clean = piece.strip().isalpha() or i in range(300, 316)
            head.bias[i] = 0.0 if clean else -6.0
    m.lm_head = head
    return m.eval()


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    return writer_model(tok)


def _settings(**kw: Any) -> SynthSettings:
    return SynthSettings(**({"model": "tiny", "max_new_tokens": 24, "min_chars": 8} | kw))


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_filters_name_each_reason() -> None:
    s = _settings(min_chars=10, max_chars=200)
    ok = "How do I sort a list of numbers in Python?"
    cases = {
        ok: None,
        "   ": "empty",
        "Hi there": "too_short",
        "word " * 100: "too_long",
        "Tell me <|im_start|> more about it": "control_token",
        "\x00\x01\x02 what is this \x03\x04\x05\x06\x07\x08\x0e\x0f": "non_text",
        "1234567890 + 987654321 = ?": "non_text",
        "caf\ufffd\ufffd\ufffd is it good \ufffd\ufffd\ufffd\ufffd": "non_text",
        "one two three " * 12: "repetitive",
    }
    for text, want in cases.items():
        assert filter_reason(text, "stop", s, ["<|im_start|>", "<|im_end|>"]) == want, text
    assert filter_reason(ok, "length", s, []) == "unfinished"


def test_dedupe_finds_normalised_and_near_duplicates_only() -> None:
    d = Deduper(0.7)
    base = (
        "Could you explain how photosynthesis works in plants, what role chlorophyll plays, "
        "and why leaves change colour in autumn when the days get shorter?"
    )
    assert d.offer(base) is None
    assert d.offer("  COULD you explain how photosynthesis works in plants; what role "
                   "chlorophyll plays and why leaves change colour in autumn when the days "
                   "get shorter!! ") == "duplicate"  # fmt: skip
    near = base.replace("shorter", "colder")  # one word of 26 changed: Jaccard ~0.85
    assert d.offer(near) == "near_duplicate"
    half = " ".join(base.split()[:13]) + " and also tell me about the ocean tides please"
    assert d.offer(half) is None  # shares about half its trigrams: a different prompt
    assert d.offer("Write a poem about the sea.") is None
    assert d.offer("write a poem about the sea") == "duplicate"
    assert d.offer("Write a poem about the moon.") is None  # short: one changed word matters
    strict = Deduper(0.95)
    strict.offer(base)
    assert strict.offer(near) is None


def test_prefix_opens_a_user_turn_with_system_and_topic(tok: Any) -> None:
    default_sys = (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nDefault helper.<|im_end|>\\n' }}"
        "{% endif %}" + tok.chat_template
    )
    t = tiny_tokenizer(default_sys)
    chat = ChatTemplate.probe(t)
    text = t.decode(user_turn_prefix(chat, None, None))
    assert text == "<|im_start|>system\nDefault helper.<|im_end|>\n<|im_start|>user\n"
    text = t.decode(user_turn_prefix(chat, "Be terse.", "math"))
    assert text == (
        "<|im_start|>system\nBe terse.\nThe user's next message is about math.<|im_end|>\n"
        "<|im_start|>user\n"
    )


def test_synthesized_prompts_are_counted_and_read_by_the_regenerator(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    out = tmp_path / "synth.jsonl"
    report = synthesize(model, tok, out, 40, _settings(topics=("math", "code")), batch_size=6,
                        progress=False)  # fmt: skip
    kept, dropped = _lines(out), _lines(tmp_path / "synth.jsonl.dropped.jsonl")
    assert report.kept == len(kept) > 0 and len(kept) + len(dropped) == 40
    assert sum(report.dropped.values()) == len(dropped) > 0
    saved = json.loads((tmp_path / "synth.jsonl.report.json").read_text())
    assert saved["kept"] == report.kept and saved["dropped"] == report.dropped
    ids = [r["id"] for r in kept + dropped]
    assert sorted(ids) == [f"synth-{i:07d}" for i in range(40)]
    assert [r["synthesis"]["topic"] for r in kept + dropped] == [
        ["math", "code"][int(i[-7:]) % 2] for i in ids
    ]
    for r in kept:
        assert filter_reason(r["messages"][-1]["content"], "stop", _settings(), []) is None
    convs = list(read_records(out, require_assistant=False))
    assert all(isinstance(c, Conversation) for c in convs) and len(convs) == len(kept)
    assert [c.messages[-1]["content"] for c in convs] == [
        r["messages"][-1]["content"] for r in kept
    ]


def test_items_do_not_depend_on_batching_or_backend(tmp_path: Path, model: Any, tok: Any) -> None:
    s = _settings(seed=5)
    synthesize(model, tok, tmp_path / "a.jsonl", 12, s, batch_size=2, chunk=3, progress=False)
    synthesize(model, tok, tmp_path / "b.jsonl", 12, s, batch_size=7, progress=False)
    a = tmp_path / "a.jsonl"
    assert a.read_text() == (tmp_path / "b.jsonl").read_text()
    assert (tmp_path / "a.jsonl.dropped.jsonl").read_text() == (
        tmp_path / "b.jsonl.dropped.jsonl"
    ).read_text()
    other = _settings(seed=6)
    synthesize(model, tok, tmp_path / "c.jsonl", 12, other, batch_size=7, progress=False)
    texts = [r.get("text") or r["messages"][-1]["content"] for r in _lines(tmp_path / "c.jsonl")]
    assert texts != [r["messages"][-1]["content"] for r in _lines(a)]
    # The HF fallback is per-item seeded as well (its draws differ from the engine's).
    hf = _settings(seed=5, backend="hf")
    synthesize(model, tok, tmp_path / "h1.jsonl", 4, hf, progress=False)
    synthesize(model, tok, tmp_path / "h2.jsonl", 4, hf, chunk=1, progress=False)
    assert (tmp_path / "h1.jsonl.dropped.jsonl").read_text() == (
        tmp_path / "h2.jsonl.dropped.jsonl"
    ).read_text()


def test_resume_refuses_other_settings_and_drops_a_partial_line(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    out = tmp_path / "s.jsonl"
    synthesize(model, tok, out, 10, _settings(), progress=False)
    whole = (out.read_text(), (tmp_path / "s.jsonl.dropped.jsonl").read_text())
    with pytest.raises(DFlashError, match=r"temperature=1\.0.*temperature=0\.9"):
        synthesize(model, tok, out, 10, _settings(temperature=0.9), progress=False)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]) + lines[-1][:25])  # killed while writing the last one
    dropped = tmp_path / "s.jsonl.dropped.jsonl"
    dropped.write_text("".join(dropped.read_text().splitlines(keepends=True)[:-2]))
    report = synthesize(model, tok, out, 10, _settings(), progress=False)
    assert report.already_done < 10
    # Re-decided items are appended after the survivors; the sets are those of the whole run.
    assert sorted(out.read_text().splitlines()) == sorted(whole[0].splitlines())
    assert sorted(dropped.read_text().splitlines()) == sorted(whole[1].splitlines())
    with pytest.raises(DFlashError, match="near-duplicate"):
        _settings(near_duplicate=0).check()


_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from test_data_support import tiny_tokenizer
from test_synthesize import writer_model, _settings
from dflash_trainer.data.synthesize import synthesize
tok = tiny_tokenizer()
synthesize(writer_model(tok), tok, {out!r}, 60, _settings(max_new_tokens=40), batch_size=2,
           chunk=2, progress=False)
"""


def _decided(out: Path) -> int:
    n = 0
    for p in (out, out.with_name(out.name + ".dropped.jsonl")):
        n += p.read_text().count("\n") if p.exists() else 0
    return n


@pytest.mark.slow
def test_a_killed_job_resumes_to_the_uninterrupted_set(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    out = tmp_path / "killed.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(tests=str(TESTS), out=str(out))],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])},
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and child.poll() is None and _decided(out) < 6:
            time.sleep(0.05)
        assert child.poll() is None, "the child finished (or died) before it could be killed"
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    before = _decided(out)
    assert 6 <= before < 60
    s = _settings(max_new_tokens=40)
    report = synthesize(model, tok, out, 60, s, batch_size=5, progress=False)
    assert report.already_done >= before - 1  # a partial last line is re-decided
    clean = tmp_path / "clean.jsonl"
    synthesize(model, tok, clean, 60, s, batch_size=5, progress=False)
    for suffix in ("", ".dropped.jsonl"):
        a = (tmp_path / f"killed.jsonl{suffix}").read_text().splitlines()
        b = (tmp_path / f"clean.jsonl{suffix}").read_text().splitlines()
        assert a == b  # same records, same order: no duplicate, nothing lost


def test_resume_dedupes_against_prompts_kept_by_an_earlier_run(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    first = tmp_path / "first.jsonl"
    synthesize(model, tok, first, 8, _settings(), progress=False)
    rec = _lines(first)[0]  # item j's prompt T, as an earlier run (another id) had kept it
    out = tmp_path / "again.jsonl"
    out.write_text(json.dumps({**rec, "id": "synth-0009999"}) + "\n")
    synthesize(model, tok, out, 8, _settings(), progress=False)
    drops = {r["id"]: r["reason"] for r in _lines(tmp_path / "again.jsonl.dropped.jsonl")}
    assert drops[rec["id"]] == "duplicate"
    assert rec["id"] not in {r["id"] for r in _lines(out)}


def test_cli_synthesizes_resumes_and_reports(
    tmp_path: Path, tok: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from dflash_trainer.cli import main

    model_dir = tmp_path / "model"
    tiny_llama(len(tok), eos_token_id=[2, *range(300, 340)]).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "p.jsonl"
    argv = ["data", "synthesize", "--model", str(model_dir), "--out", str(out), "--device", "cpu"]
    argv += ["--max-new-tokens", "6", "--topics", "math, code", "--no-progress"]
    assert main([*argv, "--n", "4"]) == 0
    assert "of 4 prompts (0 decided by an earlier run)" in capsys.readouterr().out
    assert main([*argv, "--n", "6"]) == 0
    assert "of 6 prompts (4 decided by an earlier run)" in capsys.readouterr().out
    report = json.loads((tmp_path / "p.jsonl.report.json").read_text())
    assert report["kept"] + sum(report["dropped"].values()) == 6
    assert report["settings"]["topics"] == ["math", "code"]
    assert main([*argv, "--n", "6", "--near-duplicate", "0"]) == 2
    assert "--near-duplicate 0" in capsys.readouterr().err


def test_engine_settings_reach_the_engine(tmp_path: Path, model: Any, tok: Any) -> None:
    """--compile-decode / --decode-sdpa / --decode-attention are handed to the static engine
    (a backend name it does not know is refused there, by name)."""
    with pytest.raises(DFlashError, match="unknown SDPA backend 'fast'"):
        synthesize(model, tok, tmp_path / "p.jsonl", 2, _settings(), engine={"decode_sdpa": "fast"})
