"""The static engine's rows carried into a longer cache length instead of draining
(data/engine_schedule.py), on CPU in fp32: multi-turn conversations give the same tokens with
and without carrying, greedy (equal to HF `generate` turn by turn) and sampled, and the
fallback where the longer cache has no room for the carried rows gives them too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_data_support import tiny_llama
from test_regen_engine import _hf, _lively, _prompts, _staggered_stops

from dflash_trainer.data.engine import StaticBatchEngine
from dflash_trainer.data.sampling import item_key
from dflash_trainer.data.settings import GenerationSettings

pytestmark = pytest.mark.usefixtures("one_thread")

NEW, TURNS = 16, 3
# Eight short first prompts fill an 8-row cache of 256 positions; five wait for 512 (+ 16 new
# tokens), so an 8-row cache there has three rows idle, where the short rows can go.
FIRST = [10, 30, 5, 60, 12, 25, 40, 8, 300, 320, 280, 250, 310]


def _extras() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in (20, 40)]


def _chains(engine: StaticBatchEngine, firsts: list[list[int]]) -> dict[int, list[list[int]]]:
    """Every conversation's answers, TURNS turns each, a turn's key its (chain, turn)."""
    extra = _extras()
    got: dict[int, list[list[int]]] = {c: [] for c in range(len(firsts))}
    current = list(firsts)

    def follow(chain: int, ids: list[int]) -> tuple[list[int], int] | None:
        got[chain].append(list(ids))
        t = len(got[chain])
        if t == TURNS:
            return None
        current[chain] = current[chain] + ids + extra[t - 1]
        return current[chain], item_key(5, chain, t)

    engine.generate_chains([(p, item_key(5, c, 0)) for c, p in enumerate(firsts)], follow)
    return got


def _reference(model: Any, prompt: list[int], stops: list[int]) -> list[list[int]]:
    extra, outs = _extras(), []
    for t in range(TURNS):
        outs.append(_hf(model, [prompt], NEW, stops)[0])
        if t + 1 < TURNS:
            prompt = prompt + outs[-1] + extra[t]
    return outs


def test_carried_rows_answer_as_drained_ones_greedy_and_sampled() -> None:
    model = _lively(tiny_llama(400))
    firsts = _prompts(400, FIRST)
    stops = _staggered_stops(model, firsts, NEW)
    greedy = GenerationSettings("m", max_new_tokens=NEW)

    def engine(
        settings: GenerationSettings, carry: bool, stop: list[int] = stops
    ) -> StaticBatchEngine:
        return StaticBatchEngine(model, settings, stop, 0, rows=8, carry_rows=carry)

    carried, drained = engine(greedy, True), engine(greedy, False)
    carried.trace = []
    got = _chains(carried, firsts)
    assert got == _chains(drained, firsts)
    assert got == {c: _reference(model, p, stops) for c, p in enumerate(firsts)}
    assert carried.stats.carries >= 1 and carried.stats.carried_rows >= 1, carried.stats
    assert drained.stats.carries == 0
    # The carried rows took rows the longer cache had idle: fewer decode steps, no new shape.
    assert carried.stats.decode_steps < drained.stats.decode_steps
    assert carried.stats.row_steps < drained.stats.row_steps
    assert sorted(carried.stats.shapes) == sorted(drained.stats.shapes) == [(8, 256), (8, 512)]
    # A carried conversation's later turns that would fit 256 continue in the 512 cache:
    # lengths only grow within the call.
    lengths = [step[0] for step in carried.trace]
    assert lengths == sorted(lengths) and lengths[-1] == 512

    # Sampled: a seventh of the ids stop an answer, so answers end at many depths.
    sampled = GenerationSettings("m", temperature=1.0, top_p=0.9, max_new_tokens=NEW, seed=5)
    many = list(range(3, 60))
    one, other = engine(sampled, True, many), engine(sampled, False, many)
    draws = _chains(one, firsts)
    assert draws == _chains(other, firsts) and one.stats.carries >= 1
    assert draws != got  # temperature 1 does sample


class _NoRoomAt512(StaticBatchEngine):
    """Memory as if the 512-position cache could be built beside the 256 one, but then got
    one row (a build that ran out of memory and halved): fewer than the carried rows."""

    moved = 0

    def _room_beside(self, length: int, wanted: int, carried: int) -> bool:
        return True

    def _rows_for(self, length: int, wanted: int) -> int:
        return 1 if length == 512 else super()._rows_for(length, wanted)

    def _move_rows(self, src: Any, rows: list[tuple[int, int]]) -> dict[int, int]:
        self.moved += 1
        return super()._move_rows(src, rows)


def test_carried_rows_without_room_finish_in_their_own_cache() -> None:
    model = _lively(tiny_llama(400))
    firsts = _prompts(400, FIRST)
    stops = _staggered_stops(model, firsts, NEW)
    settings = GenerationSettings("m", max_new_tokens=NEW)
    tight = _NoRoomAt512(model, settings, stops, 0, rows=8)
    got = _chains(tight, firsts)
    drained = StaticBatchEngine(model, settings, stops, 0, rows=8, carry_rows=False)
    assert got == _chains(drained, firsts)
    assert tight.stats.carries >= 1 and tight.moved == 0  # every carry fell back to draining
    assert (1, 512) in tight.stats.shapes


def test_the_occupancy_benchmark_counts_planted_answers(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/regenerate_occupancy.py on a few conversations: every answer of the planted
    model is exactly as long as the workload says (the script fails otherwise), the counts
    add up (no token lost or doubled by a carry), and the carrying engine needs no more decode
    steps than the draining one."""
    import json

    from benchmark_scripts import load_benchmark
    from test_data_support import sharegpt, tiny_tokenizer, write_jsonl

    # In sys.modules while it runs: its dataclass looks its module up there.
    bench = load_benchmark("regenerate_occupancy", monkeypatch)
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    convs = [
        sharegpt(*[(r, f"{r} {c} {t} " * (7 * c + 3 * t + 1)) for t in range(1 + c % 4)
                   for r in ("human", "gpt")], rid=str(c))
        for c in range(24)
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "convs.jsonl", convs)
    argv = ["--input", str(src), "--tokenizer", str(tmp_path / "tok"), "--conversations", "24"]
    argv += ["--rows", "8", "--kv-positions-per-row", "0"]
    results = {}
    for name, extra in (("drain", ["--no-carry-rows"]), ("carry", [])):
        assert bench.main([*argv, *extra, "--out", str(tmp_path / f"{name}.json")]) == 0
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    for r in results.values():
        first, every = r["legs"]["first_turns"], r["legs"]["all_turns"]
        assert r["workload"]["conversations"] == first["conversations"] == 24
        # The longest conversations end at the (scaled) conversation budget, as regenerate ends them.
        assert first["turns"] == 24 < every["turns"] <= sum(1 + c % 4 for c in range(24))
        for leg in (first, every):
            assert leg["answers_of_wrong_length"] == 0
            e = leg["engine"]
            # Each answer's first token comes from its prefill, every other from one busy row.
            assert e["row_steps_busy"] == leg["generated_tokens"] - leg["turns"]
            assert e["decode_steps"] == sum(
                v["decode_steps"] for v in leg["by_cache_length"].values()
            )
            assert e["row_steps_busy"] == sum(v["tokens"] for v in leg["by_cache_length"].values())
            assert (
                sum(leg["idle_row_steps_by_reason"].values())
                == e["row_steps"] - e["row_steps_busy"]
            )
    for leg in ("first_turns", "all_turns"):
        drained, carried = results["drain"]["legs"][leg], results["carry"]["legs"][leg]
        assert carried["engine"]["row_steps_busy"] == drained["engine"]["row_steps_busy"]
        assert carried["engine"]["decode_steps"] <= drained["engine"]["decode_steps"]
