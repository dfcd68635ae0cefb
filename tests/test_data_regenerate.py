"""Regeneration with a real (tiny, random-weight) Llama: on-policy turns, batching, resume."""

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
from dflash_trainer.data.hf_generate import per_prompt_generate
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.regen_output import read_done
from dflash_trainer.data.regenerate import (
    GenerationSettings,
    cut_at_stop,
    regenerate,
    stop_ids,
)
from dflash_trainer.data.template import ChatTemplate
from dflash_trainer.errors import DFlashError

TESTS = Path(__file__).parent


def _convs(n: int, turns: int = 2) -> list[Conversation]:
    """n conversations of 1..turns turns, a third of them with a system prompt."""
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for t in range(1 + i % turns):
            msgs += [
                {"role": "user", "content": f"question {i}.{t} " + "word " * (i % 5)},
                {"role": "assistant", "content": "a source answer that must be replaced"},
            ]
        out.append(Conversation(f"c{i}", msgs))
    return out


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    return tiny_llama(len(tok))


def _run(convs: list[Conversation], model: Any, tok: Any, out: Path, **kw: Any) -> Any:
    kw = {"max_new_tokens": 6, "batch_size": 3, "model_name": "tiny", "progress": False} | kw
    return regenerate(convs, model, tok, out, **kw)


def test_turns_are_answered_on_policy_and_batching_changes_nothing(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    convs = _convs(7)
    out = tmp_path / "regen.jsonl"
    report = _run(convs, model, tok, out, window=4)
    records = _lines(out)
    assert report.written == 7 and sorted(r["id"] for r in records) == sorted(c.id for c in convs)
    chat = ChatTemplate.probe(tok)
    settings = GenerationSettings("tiny", max_new_tokens=6)
    stops = stop_ids(tok, chat, model)
    by_id = {c.id: c for c in convs}
    for rec in records:
        msgs = rec["messages"]
        src = by_id[rec["id"]].messages
        assert [m["role"] for m in msgs] == [m["role"] for m in src]
        assert [m["content"] for m in msgs if m["role"] != "assistant"] == [
            m["content"] for m in src if m["role"] != "assistant"
        ]
        assert len(rec["generation"]["finish_reasons"]) == sum(m["role"] == "user" for m in src)
        # Every answer is what the model says, one prompt at a time, given the REGENERATED
        # history before it (the batched, left-padded, length-sorted run changed nothing).
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            assert m["content"] != "a source answer that must be replaced"
            prompt = chat.prompt_ids(msgs[:i])
            (new,) = per_prompt_generate(model, [prompt], settings, stops, tok.pad_token_id)
            content, _, _ = cut_at_stop(new, stops)
            assert m["content"] == tok.decode(content, skip_special_tokens=True), (rec["id"], i)


def test_records_carry_the_settings_and_read_back_as_openai_messages(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    out = tmp_path / "regen.jsonl"
    _run(_convs(4), model, tok, out, temperature=0.8, top_p=0.9, seed=3, enable_thinking=False)
    gen = _lines(out)[0]["generation"]
    assert {k: gen[k] for k in ("model", "temperature", "top_p", "max_new_tokens", "enable_thinking", "seed", "backend")} == {
        "model": "tiny", "temperature": 0.8, "top_p": 0.9, "max_new_tokens": 6,
        "enable_thinking": False, "seed": 3, "backend": "hf",
    }  # fmt: skip
    assert gen["finish_reasons"] == ["length"] * len(gen["finish_reasons"])
    assert all(n == 6 for n in gen["completion_tokens"])
    back = list(read_records(out))
    assert [c.id for c in back] == [r["id"] for r in _lines(out)]


class _MemoryLimited:
    """The real tiny model behind a GPU-memory limit: `generate` on more than `rows` prompts
    raises the OutOfMemoryError CUDA would (a CPU run cannot run out of GPU memory)."""

    def __init__(self, model: Any, rows: int) -> None:
        self.model, self.rows = model, rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def generate(self, ids: torch.Tensor, **kw: Any) -> Any:
        if ids.shape[0] > self.rows:
            raise torch.OutOfMemoryError(f"CUDA out of memory ({ids.shape[0]} rows)")
        return self.model.generate(ids, **kw)


def test_a_batch_that_runs_out_of_memory_is_split_and_gives_the_same_answers(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    convs = _convs(7)
    whole = _run(convs, model, tok, tmp_path / "whole.jsonl", batch_size=4)
    split = _run(convs, _MemoryLimited(model, 1), tok, tmp_path / "split.jsonl", batch_size=4)
    assert whole.oom_splits == 0 and split.oom_splits > 0
    assert split.written == whole.written == 7
    by_id = {r["id"]: r for r in _lines(tmp_path / "whole.jsonl")}
    assert all(r == by_id[r["id"]] for r in _lines(tmp_path / "split.jsonl"))
    with pytest.raises(DFlashError, match="single prompt"):
        _run(convs[:2], _MemoryLimited(model, 0), tok, tmp_path / "none.jsonl")


def test_resume_drops_a_partial_last_line_and_never_duplicates(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    convs = _convs(10)
    out = tmp_path / "regen.jsonl"
    _run(convs[:4], model, tok, out)
    first = out.read_text()
    # A job killed mid-write leaves the start of a record without its newline.
    partial = json.dumps({"id": convs[4].id, "messages": [], "generation": {}})[:30]
    out.write_text(first + partial)
    report = _run(convs, model, tok, out)
    assert report.already_done == 4 and report.written == 6
    ids = [r["id"] for r in _lines(out)]
    assert sorted(ids) == sorted(c.id for c in convs) and len(ids) == len(set(ids))
    assert out.read_text().startswith(first)  # finished records are never rewritten
    again = _run(convs, model, tok, out)
    assert again.written == 0 and again.already_done == 10


def test_resume_refuses_other_settings_and_foreign_lines(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    out = tmp_path / "regen.jsonl"
    _run(_convs(2), model, tok, out)
    with pytest.raises(DFlashError, match=r"max_new_tokens=6.*max_new_tokens=7"):
        _run(_convs(3), model, tok, out, max_new_tokens=7)
    out.write_text(out.read_text() + "not json\n" + out.read_text())
    with pytest.raises(DFlashError, match="line 3 is not a regeneration record"):
        read_done(out, GenerationSettings("tiny", max_new_tokens=6))


def test_prompt_limit_skips_or_cuts_conversations(tmp_path: Path, model: Any, tok: Any) -> None:
    chat = ChatTemplate.probe(tok)
    short = Conversation(
        "short", [{"role": "user", "content": "hi"}, {"role": "user", "content": "more " * 40}]
    )
    long_first = Conversation("long", [{"role": "user", "content": "word " * 80}])
    limit = len(chat.prompt_ids(short.messages[:1])) + 12  # the first turn fits, the second not
    out = tmp_path / "regen.jsonl"
    report = _run([short, long_first], model, tok, out, max_prompt_tokens=limit)
    assert (report.written, report.skipped_prompt_too_long, report.truncated_at_prompt_limit) == (
        1,
        1,
        1,
    )
    (rec,) = _lines(out)
    assert rec["id"] == "short" and [m["role"] for m in rec["messages"]] == ["user", "assistant"]


def test_max_turns_and_stop_tokens(tmp_path: Path, tok: Any) -> None:
    # All-zero logits: greedy picks id 0, made a stop id through the model's generation config.
    m = tiny_llama(len(tok), eos_token_id=0)
    with torch.no_grad():
        m.lm_head.weight.zero_()
    out = tmp_path / "regen.jsonl"
    _run(_convs(3, turns=2), m, tok, out, max_turns=1)
    for rec in _lines(out):
        assert rec["generation"]["finish_reasons"] == ["stop"]
        assert rec["generation"]["completion_tokens"] == [1]
        assert [x["role"] for x in rec["messages"] if x["role"] != "system"] == [
            "user",
            "assistant",
        ]
    assert cut_at_stop([5, 6, 2, 7], [2]) == ([5, 6], "stop", 3)
    assert cut_at_stop([5, 6], [2]) == ([5, 6], "length", 2)


_CHILD = """
import sys
sys.path.insert(0, {tests!r})
from test_data_support import tiny_llama, tiny_tokenizer
from test_data_regenerate import _convs
from dflash_trainer.data.regenerate import regenerate
tok = tiny_tokenizer()
regenerate(_convs(40), tiny_llama(len(tok)), tok, {out!r}, max_new_tokens=40, batch_size=1,
           window=1, model_name="tiny", progress=False)
"""


@pytest.mark.slow
def test_a_killed_job_resumes_without_loss_or_duplicates(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    out = tmp_path / "regen.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(tests=str(TESTS), out=str(out))],
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 3:
                break
            time.sleep(0.05)
        assert child.poll() is None, "the child finished (or died) before it could be killed"
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    done_before = len(read_done(out, GenerationSettings("tiny", max_new_tokens=40)))
    assert 3 <= done_before < 40
    report = regenerate(
        _convs(40),
        model,
        tok,
        out,
        max_new_tokens=40,
        batch_size=8,
        model_name="tiny",
        progress=False,
    )
    assert report.already_done == done_before and report.written == 40 - done_before
    ids = [r["id"] for r in _lines(out)]
    assert sorted(ids) == sorted(c.id for c in _convs(40)) and len(set(ids)) == 40


def test_compare_throughput_counts_useful_tokens_of_both_paths(model: Any, tok: Any) -> None:
    from dflash_trainer.data.throughput import compare_throughput

    chat = ChatTemplate.probe(tok)
    prompts = [chat.prompt_ids(c.messages[:1]) for c in _convs(6)]
    settings = GenerationSettings("tiny", max_new_tokens=5)
    r = compare_throughput(prompts, model, tok, settings, batch_size=4, baseline_prompts=2)
    assert r["batched_tokens"] == 6 * 5 and r["per_prompt_tokens"] == 2 * 5  # no stop: all length
    assert r["batched_tokens_per_s"] > 0 and r["per_prompt_tokens_per_s"] > 0


def _talkative(tok: Any, eos: list[int]) -> Any:
    """A tiny llama with an untied random head: with tied embeddings it repeats the prompt's
    last token forever; this one says varied tokens, and `eos` (ids it does say) make its
    turns end at different depths."""
    m = tiny_llama(len(tok), seed=1, eos_token_id=eos)
    g = torch.Generator().manual_seed(1)
    m.lm_head.weight = torch.nn.Parameter(torch.randn(m.lm_head.weight.shape, generator=g))
    return m


def _without_backend(records: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for r in records:
        gen = {k: v for k, v in r["generation"].items() if k != "backend"}
        out[r["id"]] = {**r, "generation": gen}
    return out


@pytest.mark.parametrize("max_turns", [None, 1])
def test_the_static_engine_writes_the_records_the_hf_path_writes(
    tmp_path: Path, model: Any, tok: Any, max_turns: int | None
) -> None:
    m = _talkative(tok, eos=[2, 195, 259])
    convs = _convs(9, turns=3)
    kw: dict[str, Any] = {"max_new_tokens": 12, "max_turns": max_turns, "window": 5}
    hf = _run(convs, m, tok, tmp_path / "hf.jsonl", **kw)
    static = _run(convs, m, tok, tmp_path / "static.jsonl", backend="static", **kw)
    assert (static.written, static.new_tokens) == (hf.written, hf.new_tokens)
    records = _lines(tmp_path / "static.jsonl")
    assert {r["generation"]["backend"] for r in records} == {"static"}
    assert _without_backend(records) == _without_backend(_lines(tmp_path / "hf.jsonl"))
    turns = [len(r["generation"]["finish_reasons"]) for r in records]
    assert max(turns) == (max_turns or 3)  # every user turn answered, up to max_turns
    if max_turns is None:
        reasons = {x for r in records for x in r["generation"]["finish_reasons"]}
        assert reasons == {"stop", "length"}


def test_conversation_budget_cuts_at_a_turn_boundary_and_prepare_keeps_every_turn(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    chat = ChatTemplate.probe(tok)
    convs = _convs(8, turns=3)
    free = tmp_path / "free.jsonl"
    _run(convs, model, tok, free, max_new_tokens=8)
    full = {r["id"]: r for r in _lines(free)}

    def length(messages: list[dict[str, str]]) -> int:
        return len(tok(chat.render(messages), add_special_tokens=False)["input_ids"])

    lengths = sorted(length(r["messages"]) for r in full.values())
    budget = lengths[len(lengths) // 2]  # about half the conversations are too long
    out = tmp_path / "cut.jsonl"
    report = _run(convs, model, tok, out, max_new_tokens=8, max_conversation_tokens=budget)
    cut = {r["id"]: r for r in _lines(out)}
    assert report.cut_at_conversation_limit > 0
    assert report.written + report.skipped_conversation_too_long == len(convs)
    n_cut = 0
    for rid, rec in cut.items():
        msgs = rec["messages"]
        assert length(msgs) <= budget and msgs[-1]["role"] == "assistant"
        whole = full[rid]["messages"]
        assert msgs == whole[: len(msgs)]  # a prefix of the uncut conversation, whole turns
        n_cut += len(msgs) < len(whole)
        assert len(rec["generation"]["finish_reasons"]) == sum(m["role"] == "user" for m in msgs)
        # One training document per conversation, every assistant turn supervised.
        (doc,) = chat.tokenize([Conversation(rid, msgs)])
        spans = int((doc.loss_mask[1:] & ~doc.loss_mask[:-1]).sum() + doc.loss_mask[0])
        assert spans == sum(m["role"] == "assistant" for m in msgs)
    assert n_cut == report.cut_at_conversation_limit
    skipped = [c.id for c in convs if c.id not in cut]
    assert len(skipped) == report.skipped_conversation_too_long


class _Interrupting:
    """The real engine, with a Ctrl-C arriving as the `at`-th answer comes in."""

    max_batch = None

    def __init__(self, engine: Any, at: int) -> None:
        self.engine, self.at, self.answers = engine, at, 0

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        return self.engine.generate(prompts)  # type: ignore[no-any-return]

    def generate_chains(self, first: Any, follow: Any) -> None:
        def counted(chain: int, new_ids: list[int]) -> Any:
            self.answers += 1
            if self.answers == self.at:
                raise KeyboardInterrupt
            return follow(chain, new_ids)

        self.engine.generate_chains(first, counted)


def test_an_interrupted_job_keeps_the_answered_turns_of_open_conversations(
    tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    regen = importlib.import_module("dflash_trainer.data.regenerate")  # the module, not the
    # function of the same name that dflash_trainer.data exports

    m = _talkative(tok, eos=[2, 195, 259])
    convs = _convs(9, turns=3)
    kw: dict[str, Any] = {"max_new_tokens": 12, "window": 9, "backend": "static"}
    full = _run(convs, m, tok, tmp_path / "full.jsonl", **kw)
    assert full.written == 9
    whole = {r["id"]: r for r in _lines(tmp_path / "full.jsonl")}
    real = regen.make_generator
    monkeypatch.setattr(regen, "make_generator", lambda *a, **k: _Interrupting(real(*a, **k), 8))
    out = tmp_path / "regen.jsonl"
    with pytest.raises(KeyboardInterrupt):
        _run(convs, m, tok, out, **kw)
    kept = _lines(out)
    assert 0 < len(kept) < 9
    assert sum(len(r["generation"]["finish_reasons"]) for r in kept) == 7  # no answer lost
    for r in kept:  # each is the uninterrupted record cut after its answered turns
        n = len(r["generation"]["finish_reasons"])
        assert sum(x["role"] == "assistant" for x in r["messages"]) == n
        assert r["messages"] == whole[r["id"]]["messages"][: len(r["messages"])]
    monkeypatch.undo()
    still_open = [r for r in kept if r["generation"]["open"]]
    assert still_open, "the interrupt must leave a conversation with turns unanswered"
    rerun = _run(convs, m, tok, out, **kw)  # the rest, open ones continued from their turns
    assert rerun.continued == len(still_open)
    assert rerun.already_done == len(kept) - len(still_open) and rerun.written == 9 - (
        len(kept) - len(still_open)
    )
    _assert_same_records(_lines(out), whole)


def _assert_same_records(records: list[dict[str, Any]], whole: dict[str, Any]) -> None:
    """One record per conversation, each what the uninterrupted job wrote."""
    assert sorted(r["id"] for r in records) == sorted(whole)
    for r in records:
        w = whole[r["id"]]
        assert r["messages"] == w["messages"], r["id"]
        assert r["generation"] == w["generation"], r["id"]


def test_engine_settings_reach_the_engine(tmp_path: Path, model: Any, tok: Any) -> None:
    with pytest.raises(DFlashError, match="add --compile-decode"):
        _run(_convs(2), model, tok, tmp_path / "r.jsonl", backend="static",
             engine={"decode_attention": "flex"})  # fmt: skip


@pytest.mark.parametrize("backend", ["static", "hf"])
def test_a_time_limit_stops_at_an_answer_and_keeps_every_answered_turn(
    tmp_path: Path, tok: Any, backend: str
) -> None:
    m = _talkative(tok, eos=[2, 195, 259])
    convs = _convs(9, turns=3)
    kw: dict[str, Any] = {"max_new_tokens": 12, "window": 9, "backend": backend}
    _run(convs, m, tok, tmp_path / "whole.jsonl", **kw)
    whole = {r["id"]: r for r in _lines(tmp_path / "whole.jsonl")}
    out = tmp_path / "regen.jsonl"
    first = _run(convs, m, tok, out, time_limit=1e-9, **kw)  # stops at the first answer(s)
    kept = _lines(out)
    assert first.time_limit_reached and 0 < len(kept) < 9
    assert first.written == len(kept) and first.cut_at_interrupt >= 1
    assert sum(len(r["generation"]["finish_reasons"]) for r in kept) == sum(
        first.finish_reasons.values()
    )
    for r in kept:
        assert r["messages"] == whole[r["id"]]["messages"][: len(r["messages"])]
    assert all(r["generation"]["open"] == (r["id"] in _open(kept, convs)) for r in kept)
    rest = _run(convs, m, tok, out, **kw)
    assert not rest.time_limit_reached and rest.continued == len(_open(kept, convs))
    assert rest.written == 9 - len(kept) + rest.continued
    assert sum(rest.finish_reasons.values()) + sum(first.finish_reasons.values()) == sum(
        len(r["generation"]["finish_reasons"]) for r in whole.values()
    )  # every turn answered once
    _assert_same_records(_lines(out), whole)


def _open(records: list[dict[str, Any]], convs: list[Conversation]) -> set[str]:
    users = {c.id: sum(m["role"] == "user" for m in c.messages) for c in convs}
    return {r["id"] for r in records if len(r["generation"]["finish_reasons"]) < users[r["id"]]}


def test_a_crash_before_compaction_is_compacted_by_the_next_job(tmp_path: Path, tok: Any) -> None:
    """A continued conversation's longer record is appended before the older one is removed:
    killed in between, the file holds both; the next job keeps the later one, once, and
    continues it if it is still open."""
    m = _talkative(tok, eos=[2, 195, 259])
    convs = _convs(6, turns=3)
    kw: dict[str, Any] = {"max_new_tokens": 12, "window": 6, "backend": "static"}
    _run(convs, m, tok, tmp_path / "whole.jsonl", **kw)
    whole = _lines(tmp_path / "whole.jsonl")
    multi = [r for r in whole if len(r["generation"]["finish_reasons"]) > 1]
    three = next(r for r in multi if len(r["generation"]["finish_reasons"]) == 3)
    older = [_cut(r, 1) for r in multi]  # what an interrupt after the first answer writes
    later = [_cut(three, 2) if r is three else r for r in whole]  # one still open
    out = tmp_path / "regen.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in [*older, *later]))
    again = _run(convs, m, tok, out, **kw)
    assert again.continued == 1 and again.written == 1 and again.already_done == 5
    _assert_same_records(_lines(out), {r["id"]: r for r in whole})


def _cut(rec: dict[str, Any], turns: int) -> dict[str, Any]:
    """`rec` as an interrupt after its first `turns` answers writes it."""
    msgs = rec["messages"]
    head = 1 if msgs[0]["role"] == "system" else 0
    gen = dict(rec["generation"], open=True)
    gen["finish_reasons"] = gen["finish_reasons"][:turns]
    gen["completion_tokens"] = gen["completion_tokens"][:turns]
    return {"id": rec["id"], "messages": msgs[: head + 2 * turns], "generation": gen}


def test_a_record_that_no_longer_matches_its_input_is_not_continued(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    convs = _convs(2, turns=2)  # c1 has two user turns
    out = tmp_path / "regen.jsonl"
    _run(convs[1:], model, tok, out, max_turns=1)
    (rec,) = _lines(out)
    rec["generation"]["open"] = True  # as an interrupt leaves it
    out.write_text(json.dumps(rec) + "\n")
    edited = Conversation("c1", [{"role": "user", "content": "another first question"},
                                 *convs[1].messages[1:]])  # fmt: skip
    report = _run([edited], model, tok, out)
    assert report.continued == 0 and report.already_done == 1 and report.written == 0
    assert _lines(out) == [rec]
    report = _run(convs[1:], model, tok, out)  # the input it answered: its second turn now
    assert report.continued == 1 and report.written == 1
    (done,) = _lines(out)
    assert done["messages"][:2] == rec["messages"] and len(done["messages"]) == 4
    assert done["generation"]["open"] is False


def test_the_cli_refuses_a_time_limit_that_is_not_positive(tmp_path: Path) -> None:
    from dflash_trainer.cli import main

    for bad in ("0", "-5", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as e:
            main(["data", "regenerate", "--input", "x.jsonl", "--out", str(tmp_path / "o"),
                  "--time-limit", bad])  # fmt: skip
        assert e.value.code == 2
