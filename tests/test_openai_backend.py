"""`--backend openai`: regeneration and synthesis through a real OpenAI-compatible HTTP server
(tests/openai_test_server.py, answering with a tiny real Llama's generate), against the
built-in HF path's records, with the server failing in every way a real one does."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from openai_test_server import Fault, OpenAITestServer, ServerState
from test_data_support import tiny_llama, tiny_tokenizer

from dflash_trainer.cli import main
from dflash_trainer.data.openai_backend import ServerOptions
from dflash_trainer.data.openai_client import OpenAIClient, parse_answer, retry_after
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.regenerate import regenerate
from dflash_trainer.data.synthesize import SynthSettings, synthesize
from dflash_trainer.errors import DFlashError

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 8


def _convs(n: int = 6) -> list[Conversation]:
    """n conversations of one or two turns, a third of them with a system prompt."""
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for t in range(1 + i % 2):
            msgs += [
                {"role": "user", "content": f"question {i}.{t} " + "word " * (i % 4)},
                {"role": "assistant", "content": "a source answer that must be replaced"},
            ]
        out.append(Conversation(f"c{i}", msgs))
    return out


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _records(path: Path) -> dict[str, Any]:
    """id -> record, the backend left out (the one setting allowed to differ)."""
    out = {}
    for r in _lines(path):
        r["generation"].pop("backend")
        out[r["id"]] = r
    return out


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    return tiny_llama(len(tok))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: Any, model: Any, tok: Any) -> dict[str, Any]:
    """The built-in HF path's records of _convs()."""
    out = tmp_path_factory.mktemp("ref") / "hf.jsonl"
    _regen(_convs(), out, model=model, tok=tok, backend="hf")
    return _records(out)


def _regen(convs: list[Conversation], out: Path, tok: Any, **kw: Any) -> Any:
    kw = {"max_new_tokens": NEW, "model_name": "tiny", "progress": False, "batch_size": 4} | kw
    return regenerate(convs, kw.pop("model", None), tok, out, **kw)


def _server(url: str, endpoint: str = "completions", concurrency: int = 1, **kw: Any) -> Any:
    client = OpenAIClient(url, "tiny", **({"backoff": 0.001, "retries": 3} | kw))
    client.check_model()
    return ServerOptions(client, endpoint, concurrency)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_records_through_a_server_equal_the_built_in_engines(
    tmp_path: Path, model: Any, tok: Any, reference: dict[str, Any], endpoint: str
) -> None:
    state = ServerState(model, tok)
    with OpenAITestServer(state) as url:
        server = _server(url, endpoint, concurrency=3)
        report = _regen(_convs(), tmp_path / "o.jsonl", tok, backend="openai", server=server)
    assert _records(tmp_path / "o.jsonl") == reference
    assert report.written == 6 and report.not_answered == 0
    assert report.server["answered"] == report.server["requests"] == 9  # 6 first + 3 second turns
    assert report.server["failed"] == report.server["retokenized"] == 0
    assert report.server["completion_tokens"] == report.new_tokens
    first = state.requests[0]
    assert first["max_tokens"] == NEW and first["temperature"] == 0.0
    assert first["return_token_ids"] is True and first["stop_token_ids"]
    # Per-request seeds: item_key(seed, conversation id, turn), distinct per turn.
    assert len({r["seed"] for r in state.requests}) == 9


def test_a_text_only_server_gives_the_same_text_and_counts_where_tokens_round_trip(
    tmp_path: Path, model: Any, tok: Any, reference: dict[str, Any]
) -> None:
    state = ServerState(model, tok, token_ids=False)
    with OpenAITestServer(state) as url:
        report = _regen(_convs(), tmp_path / "o.jsonl", tok, backend="openai", server=_server(url))
    got = _records(tmp_path / "o.jsonl")
    assert report.server["retokenized"] == 9
    same_counts = 0
    for rid, ref in reference.items():
        assert got[rid]["messages"] == ref["messages"]  # byte-level BPE: text round-trips
        gen, ref_gen = got[rid]["generation"], ref["generation"]
        assert gen["finish_reasons"] == ref_gen["finish_reasons"]
        answers = [m["content"] for m in ref["messages"] if m["role"] == "assistant"]
        for text, n, ref_n, why in zip(
            answers, gen["completion_tokens"], ref_gen["completion_tokens"], gen["finish_reasons"]
        ):
            retok = len(tok(text, add_special_tokens=False)["input_ids"]) + (why == "stop")
            assert n == retok  # what the text gives; equal to the engine's where it round-trips
            same_counts += n == ref_n
    assert same_counts > 0


def test_a_stop_at_an_eos_only_the_model_declares_is_recorded_as_the_engine_records_it(
    tmp_path: Path, tok: Any
) -> None:
    """The server stops at an EOS of the model's generation config that the tokenizer does not
    name (the job asks with the tokenizer's stops only): still a stop, counted the same."""
    m = tiny_llama(len(tok), eos_token_id=[2, 300])
    with torch.no_grad():
        m.lm_head = torch.nn.Linear(64, len(tok), bias=True)
        m.lm_head.weight.copy_(m.model.embed_tokens.weight)
        m.lm_head.bias.zero_()
        m.lm_head.bias[300] = 4.0  # ends most answers after a few tokens
    _regen(_convs(), tmp_path / "hf.jsonl", tok, model=m, backend="hf")
    with OpenAITestServer(ServerState(m, tok)) as url:
        _regen(_convs(), tmp_path / "o.jsonl", tok, backend="openai", server=_server(url))
    want = _records(tmp_path / "hf.jsonl")
    assert _records(tmp_path / "o.jsonl") == want
    assert any("stop" in r["generation"]["finish_reasons"] for r in want.values())


def test_transient_failures_are_retried_and_counted(
    tmp_path: Path, model: Any, tok: Any, reference: dict[str, Any]
) -> None:
    faults = [Fault("500"), Fault("429"), Fault("garbage"), Fault("close"), Fault("slow")]
    state = ServerState(model, tok, faults=faults, retry_after="0.3", slow_seconds=0.6)
    with OpenAITestServer(state) as url:
        server = _server(url, timeout=0.3, retries=5)
        t0 = time.perf_counter()
        report = _regen(_convs(), tmp_path / "o.jsonl", tok, backend="openai", server=server)
        took = time.perf_counter() - t0
    assert _records(tmp_path / "o.jsonl") == reference
    s = report.server
    assert s["http_errors"] == {"500": 1, "429": 1}
    assert (s["garbage"], s["dropped_connections"], s["timeouts"]) == (1, 1, 1)
    assert s["retries"] == 5 and s["failed"] == 0 and s["requests"] == 9 + 5
    assert took >= 0.3 + 0.3  # Retry-After was waited for, and the timeout
    assert report.not_answered == 0


def test_failed_and_short_answers_are_counted_kept_open_and_finished_by_a_rerun(
    tmp_path: Path, model: Any, tok: Any, reference: dict[str, Any]
) -> None:
    out = tmp_path / "o.jsonl"
    faults = [
        Fault("500", "question 2.0", times=4),  # retries spent: c2 is not written
        Fault("short", "question 1.1"),  # c1's second turn: c1 kept open with one turn
        Fault("400", "question 3.1"),  # refused at once: c3 kept open with one turn
    ]
    state = ServerState(model, tok, faults=faults)
    with OpenAITestServer(state) as url:
        report = _regen(_convs(), out, tok, backend="openai", server=_server(url))
    s = report.server
    assert report.not_answered == 3 and report.written == 5
    assert s["failed"] == 2 and s["rejected"] == 1 and s["short_answers"] == 1
    assert s["http_errors"] == {"500": 4, "400": 1} and s["retries"] == 3
    partial = {r["id"]: r for r in _lines(out)}
    assert "c2" not in partial
    for rid in ("c1", "c3"):
        assert partial[rid]["generation"]["open"] is True
        assert len(partial[rid]["generation"]["finish_reasons"]) == 1
    with OpenAITestServer(ServerState(model, tok)) as url:
        again = _regen(_convs(), out, tok, backend="openai", server=_server(url))
    assert again.already_done == 3 and again.continued == 2 and again.written == 3
    assert _records(out) == reference  # continued records compacted: one per conversation


def test_an_unreachable_server_or_a_model_it_does_not_serve_is_a_clear_error(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    with (
        OpenAITestServer(ServerState(model, tok)) as url,
        pytest.raises(DFlashError, match="serves \\['tiny'\\], not 'other'"),
    ):
        OpenAIClient(url, "other").check_model()
    with pytest.raises(DFlashError, match="no OpenAI-compatible server answers"):
        OpenAIClient(url, "tiny").check_model()  # the server is gone
    with pytest.raises(DFlashError, match="http:// or https://"):
        OpenAIClient("file:///etc/passwd", "tiny")


def test_answers_that_are_not_completions_are_refused() -> None:
    good = {"choices": [{"text": "hi", "finish_reason": "stop"}], "usage": {}}
    assert parse_answer(json.dumps(good).encode(), "completions") is not None
    assert parse_answer(json.dumps(good).encode(), "chat") is None
    for bad in (b"", b"[]", b'{"choices": []}', b'{"choices": [{"text": 1}]}', b"\xff"):
        assert parse_answer(bad, "completions") is None
    ids = {"choices": [{"text": "", "finish_reason": "stop", "token_ids": ["1"]}]}
    assert parse_answer(json.dumps(ids).encode(), "completions") is None
    assert retry_after("2") == 2.0 and retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None


def test_the_cli_regenerates_through_a_server(
    tmp_path: Path, model: Any, tok: Any, reference: dict[str, Any]
) -> None:
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in _convs())
    )
    out = tmp_path / "o.jsonl"
    args = ["data", "regenerate", "--input", str(src), "--tokenizer", str(tok_dir)]
    args += ["--model", "tiny", "--out", str(out), "--max-new-tokens", str(NEW), "--no-progress"]
    with OpenAITestServer(ServerState(model, tok)) as url:
        assert main([*args, "--backend", "openai"]) == 2  # no --base-url: a clear error
        assert main([*args, "--backend", "openai", "--base-url", url, "--concurrency", "2"]) == 0
    assert _records(out) == reference
    run = json.loads((tmp_path / "o.jsonl.runs.jsonl").read_text().splitlines()[-1])
    assert run["server"]["answered"] == 9 and run["not_answered"] == 0


def test_synthesis_through_a_server_equals_the_hf_path_and_leaves_failures_for_a_rerun(
    tmp_path: Path, tok: Any
) -> None:
    m = tiny_llama(len(tok), seed=3)
    with torch.no_grad():  # whole-word tokens and the end of turn likely: some prompts survive
        bias = [0.0 if tok.decode([i]).strip().isalpha() else -6.0 for i in range(len(tok))]
        bias[tok.eos_token_id] = 2.5
        g = torch.Generator().manual_seed(1)
        m.lm_head = torch.nn.Linear(64, len(tok), bias=True)
        m.lm_head.weight.copy_(torch.randn(len(tok), 64, generator=g) * 0.3)
        m.lm_head.bias.copy_(torch.tensor(bias))
    settings = SynthSettings(model="tiny", max_new_tokens=12, min_chars=4, backend="hf")
    synthesize(m, tok, tmp_path / "hf.jsonl", 10, settings, progress=False)
    served = SynthSettings(**{**settings.__dict__, "backend": "openai"})
    state = ServerState(m, tok, faults=[Fault("500", times=4)])
    out = tmp_path / "o.jsonl"
    with OpenAITestServer(state) as url:
        first = synthesize(None, tok, out, 10, served, progress=False, server=_server(url))
        assert first.not_answered == 1 and first.server["failed"] == 1
        again = synthesize(None, tok, out, 10, served, progress=False, server=_server(url))
    assert again.not_answered == 0 and again.already_done == 9
    want = {r["id"]: r["messages"] for r in _lines(tmp_path / "hf.jsonl")}
    got = {r["id"]: r["messages"] for r in _lines(out)}
    assert got == want and len(want) > 0
    dropped = tmp_path / "hf.jsonl.dropped.jsonl"
    want_dropped = {r["id"]: r["reason"] for r in _lines(dropped)}
    got_dropped = {r["id"]: r["reason"] for r in _lines(tmp_path / "o.jsonl.dropped.jsonl")}
    assert got_dropped == want_dropped
    with pytest.raises(DFlashError, match="completions endpoint"):
        synthesize(None, tok, out, 10, served, progress=False, server=ServerOptions(
            OpenAIClient("http://127.0.0.1:9/v1", "tiny"), "chat"))  # fmt: skip
