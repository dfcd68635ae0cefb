"""Regeneration's loop stop: where it cuts, that the engine (stopping while it decodes) and the
HF path (cutting afterwards) write the same records, and that prepare masks what it keeps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_data_support import tiny_llama, tiny_tokenizer

from dflash_trainer.data.loop_tails import (
    MIN_LOOP,
    STOP_EVERY,
    loop_onset,
    loop_stop,
    loops_now,
)
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.regenerate import cut_at_stop, regenerate


def _looping(prefix: int, period: int, total: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    cycle = rng.integers(1000, 50000, period)
    body = np.tile(cycle, -(-(total - prefix) // period))
    return np.concatenate([rng.integers(1000, 50000, prefix), body])[:total].tolist()


@pytest.mark.parametrize(("prefix", "period"), [(0, 1), (40, 7), (150, 23), (300, 60)])
def test_the_cut_is_the_first_multiple_at_which_the_answer_loops(prefix: int, period: int) -> None:
    toks = _looping(prefix, period, 640)
    cut = loop_stop(toks)
    assert cut is not None and cut % STOP_EVERY == 0
    onset = loop_onset(np.array(toks[:cut]))
    assert onset is not None and cut - onset >= MIN_LOOP  # the kept loop is long enough to mask
    assert loop_onset(np.array(toks[: cut - STOP_EVERY])) is None  # no earlier look fires
    # the engine's look at each multiple agrees: it fires at the cut and at no earlier multiple
    fired = [n for n in range(STOP_EVERY, cut + 1, STOP_EVERY) if loops_now(toks[:n])]
    assert fired == [cut]
    assert loop_stop(toks[:cut]) == cut  # the cut answer, looked at again, is cut where it ends


def test_varied_or_short_answers_are_not_cut() -> None:
    varied = np.random.default_rng(3).integers(1000, 50000, 600).tolist()
    assert loop_stop(varied) is None
    assert loop_stop(_looping(0, 1, 3 * STOP_EVERY - 1)) is None  # no multiple with a long loop


def test_cut_at_stop_ends_a_looping_answer_before_its_stop_token() -> None:
    toks = _looping(50, 9, 500)
    cut = loop_stop(toks)
    assert cut is not None
    assert cut_at_stop(toks, [2], stop_loops=True) == (toks[:cut], "loop", cut)
    assert cut_at_stop([*toks[:300], 2, 7], [2], stop_loops=True) == (toks[:cut], "loop", cut)
    assert cut_at_stop([*toks[:100], 2], [2], stop_loops=True) == (toks[:100], "stop", 101)
    assert cut_at_stop(toks, [2]) == (toks, "length", 500)  # off by default


def _convs(n: int) -> list[Conversation]:
    out = []
    for i in range(n):
        msgs = []
        for t in range(1 + i % 2):
            msgs += [
                {"role": "user", "content": f"question {i}.{t} " + "word " * i},
                {"role": "assistant", "content": "a source answer"},
            ]
        out.append(Conversation(f"c{i}", msgs))
    return out


def _records(path: Path) -> dict[str, Any]:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        rec["generation"].pop("backend")
        out[rec["id"]] = rec
    return out


def test_the_engine_stops_loops_where_the_hf_path_cuts_them(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))  # tied embeddings: it repeats the prompt's last token forever
    kw: dict[str, Any] = {"max_new_tokens": 320, "batch_size": 3, "progress": False}
    kw |= {"model_name": "tiny", "stop_loops": True}
    convs = _convs(5)
    hf = regenerate(convs, model, tok, tmp_path / "hf.jsonl", **kw)
    static = regenerate(convs, model, tok, tmp_path / "static.jsonl", backend="static", **kw)
    assert _records(tmp_path / "static.jsonl") == _records(tmp_path / "hf.jsonl")
    assert static.new_tokens == hf.new_tokens
    assert static.finish_reasons.get("loop", 0) == hf.finish_reasons["loop"] > 0
    # the engine stopped decoding those rows: fewer row steps than answers at full length
    assert static.engine is not None
    assert static.engine["row_steps_busy"] < 320 * sum(hf.finish_reasons.values())
    rec = next(iter(_records(tmp_path / "hf.jsonl").values()))
    assert rec["generation"]["stop_loops"] is True
