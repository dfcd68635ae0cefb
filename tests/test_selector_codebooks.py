"""DFlash2's selector codebooks trained through the target embedding (selector_codebooks=embedding):
a no-op at the start, the same scores as the tables it writes, resumable, refused where it
cannot apply."""

from __future__ import annotations

import pytest
import torch
from trainer_utils import stop_after_checkpoint, tiny_config

from dflash_trainer.config import ConfigError
from dflash_trainer.core.dflash2 import (
    CandidateSelector,
    DamagedFactors,
    serving_state,
    training_state,
    walk_greedy,
)
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.drafter_io import build_drafter, load_drafter
from dflash_trainer.train.checkpoint import Checkpointer
from dflash_trainer.train.run_dir import read_metrics
from dflash_trainer.train.trainer import Trainer

D2 = {
    "kind": "dflash2",
    "conv_group_size": 8,
    "selector_rank": 8,
    "selector_top_k": 4,
    "selector_codebooks": "embedding",
}


def _trained_embedding_selector(vocab=40, hidden=12, rank=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    sel = CandidateSelector(hidden, vocab, rank, codebooks="embedding")
    sel.attach_embedding(torch.randn(vocab, hidden, generator=g))
    with torch.no_grad():
        sel.successor_projection.normal_(generator=g)
    return sel, g


def test_embedding_selector_starts_as_a_no_op_and_its_rows_are_unit_spread():
    sel = CandidateSelector(12, 40, 6, codebooks="embedding")
    emb = torch.randn(40, 12) * 7.0
    sel.attach_embedding(emb)
    # E' rows have unit mean square norm whatever the embedding's scale.
    assert float(sel.embedding.pow(2).sum(-1).mean()) == pytest.approx(1.0, rel=1e-5)
    h, prev = torch.randn(5, 12), torch.randint(0, 40, (5,))
    cand, unary = torch.randint(0, 40, (5, 4)), torch.randn(5, 4)
    assert torch.equal(sel(h, prev, cand, unary), unary)


def test_the_tables_it_writes_score_exactly_as_it_does():
    """serving_state's codebooks, loaded into a tables-mode selector, give the same scores and
    the same lattice (hence the same walks) as the embedding-mode selector that trained."""
    sel, g = _trained_embedding_selector()
    tables = CandidateSelector(12, 40, 6)
    state, factors = serving_state(sel.state_dict(), sel)
    assert sorted(factors) == ["predecessor_projection", "successor_projection"]
    assert sorted(state) == [
        "hidden_projection.weight",
        "predecessor_codebook",
        "successor_codebook",
    ]
    assert state["predecessor_codebook"].shape == (40, 6)
    tables.load_state_dict(state, strict=True)
    h, prev = torch.randn(7, 12, generator=g), torch.randint(0, 40, (7,), generator=g)
    cand, unary = torch.randint(0, 40, (7, 4), generator=g), torch.randn(7, 4, generator=g)
    torch.testing.assert_close(tables(h, prev, cand, unary), sel(h, prev, cand, unary))
    hs, anchor = torch.randn(5, 12, generator=g), torch.tensor(3)
    cs, us = torch.randint(0, 40, (5, 4), generator=g), torch.randn(5, 4, generator=g)
    la, lb = sel.lattice(hs, anchor, cs, us), tables.lattice(hs, anchor, cs, us)
    torch.testing.assert_close(la, lb)
    assert torch.equal(walk_greedy(la), walk_greedy(lb))
    # Many rows (a training step's candidates) take the whole-codebook path: same rows.
    many = torch.randint(0, 40, (3, 30), generator=g)
    torch.testing.assert_close(
        sel._rows(True, many), torch.stack([sel._rows(True, row) for row in many])
    )
    # And back: the factors replace the tables for a resume.
    back = training_state(state, factors, sel)
    assert sorted(back) == sorted(sel.state_dict())
    with pytest.raises(ValueError, match="no selector factors"):
        training_state(state, {}, sel)
    with pytest.raises(ValueError, match="holds selector factors"):
        training_state(state, factors, tables)


def test_a_pair_learned_on_one_token_reaches_a_token_with_the_same_embedding():
    """What the parameterisation is for: tables learn only the rows they see; through the
    embedding, a token whose embedding equals a trained token's scores the same."""
    vocab, hidden = 30, 12
    emb = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(3))
    emb[7] = emb[5]  # token 7 is never trained on but shares token 5's embedding
    results = {}
    for mode in ("tables", "embedding"):
        torch.manual_seed(0)
        sel = CandidateSelector(hidden, vocab, 6, codebooks=mode)
        sel.attach_embedding(emb)
        opt = torch.optim.Adam(sel.parameters(), lr=0.05)
        h = torch.randn(1, hidden)
        for _ in range(60):
            # Predecessor 2: candidate 5 must beat candidate 9 (equal unary scores).
            s = sel(h, torch.tensor([2]), torch.tensor([[9, 5]]), torch.zeros(1, 2))
            loss = torch.nn.functional.cross_entropy(s, torch.tensor([1]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            s = sel(h, torch.tensor([2]), torch.tensor([[5, 7]]), torch.zeros(1, 2))
        results[mode] = (float(s[0, 0]), float(s[0, 1]))
    # Tables: row 7 never moved, its pair term is still 0 while token 5's grew.
    assert results["tables"][1] == 0.0 and results["tables"][0] > 1.0
    # Embedding: token 7 gets exactly what token 5 learned.
    assert results["embedding"][1] == pytest.approx(results["embedding"][0], rel=1e-5)
    assert results["embedding"][0] > 1.0


def test_an_embedding_mode_run_writes_tables_resumes_exactly_and_serves_what_it_trained(tmp_path):
    full = tiny_config(tmp_path, drafter=D2, run={"output_dir": str(tmp_path / "full")})
    done = Trainer(full, log_to_console=False)
    done.train()
    spec, state, _ = load_drafter(tmp_path / "full")
    assert state["candidate_selector.predecessor_codebook"].shape == (spec.vocab_size, 8)
    assert not any("projection" in k and "selector" in k and "hidden" not in k for k in state)
    # The file serves exactly as the live embedding-mode selector scores.
    model, _ = build_drafter(tmp_path / "full")
    live = done.drafter.candidate_selector
    assert float(live.successor_projection.detach().abs().sum()) > 0
    g = torch.Generator().manual_seed(1)
    h, prev = torch.randn(6, spec.hidden_size, generator=g), torch.randint(0, 60, (6,), generator=g)
    cand, unary = torch.randint(0, 60, (6, 4), generator=g), torch.randn(6, 4, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(
            model.candidate_selector(h, prev, cand, unary), live(h, prev, cand, unary)
        )
    ckpt = Checkpointer(str(tmp_path / "full" / "checkpoints"))
    assert (
        tmp_path / "full" / "checkpoints" / ckpt.latest() / "selector_factors.safetensors"
    ).is_file()

    part = tiny_config(tmp_path, drafter=D2, run={"output_dir": str(tmp_path / "part")})
    stop_after_checkpoint(part)
    Trainer(part, resume=True, log_to_console=False).train()
    a = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "full")]
    b = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "part")]
    assert a == b


def test_embedding_mode_is_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(ConfigError, match="selector_codebooks"):
        tiny_config(tmp_path, drafter={"selector_codebooks": "embedding"})
    tables = {k: v for k, v in D2.items() if k != "selector_codebooks"}
    v2 = tiny_config(
        tmp_path, drafter=tables, training={"max_steps": 2}, run={"output_dir": str(tmp_path / "t")}
    )
    Trainer(v2, log_to_console=False).train()
    cont = tiny_config(
        tmp_path,
        drafter={**D2, "init_from": str(tmp_path / "t")},
        run={"output_dir": str(tmp_path / "e")},
    )
    with pytest.raises(DFlashError, match="trained tables"):
        Trainer(cont, log_to_console=False)
    # A resume with the other parameterisation names the setting.
    other = tiny_config(
        tmp_path, drafter=D2, training={"max_steps": 4}, run={"output_dir": str(tmp_path / "t")}
    )
    with pytest.raises(DFlashError, match="selector_codebooks"):
        Trainer(other, resume=True, log_to_console=False)


@pytest.mark.parametrize(
    ("factors", "says"),
    [
        ({"s.predecessor_projection": torch.zeros(12, 6)}, "not exactly"),
        (
            {
                "s.predecessor_projection": torch.zeros(12, 6),
                "s.successor_projection": torch.zeros(12, 6),
                "s.extra": torch.zeros(2),
            },
            "not exactly",
        ),
        (
            {
                "s.predecessor_projection": torch.zeros(12, 6, dtype=torch.int32),
                "s.successor_projection": torch.zeros(12, 6),
            },
            "not floating point",
        ),
        (
            {
                "s.predecessor_projection": torch.zeros(12, 6),
                "s.successor_projection": torch.full((12, 6), float("nan")),
            },
            "NaN or infinite",
        ),
    ],
)
def test_selector_factors_that_this_trainer_did_not_write_are_refused_by_name(factors, says):
    sel, _ = _trained_embedding_selector()
    with pytest.raises(DamagedFactors, match=says):
        training_state({}, factors, sel)


def test_a_resume_from_nan_selector_factors_names_the_file_not_the_data(tmp_path):
    from safetensors.torch import load_file, save_file

    part = tiny_config(tmp_path, drafter=D2, run={"output_dir": str(tmp_path / "part")})
    stop_after_checkpoint(part)
    ck = tmp_path / "part" / "checkpoints"
    step = ck / Checkpointer(str(ck)).latest()
    f = step / "selector_factors.safetensors"
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(str(f)).items()}, str(f))
    (step / "checksums.json").unlink()  # an edit by hand, with no checksums left to catch it
    with pytest.raises(DFlashError, match=r"selector_factors\.safetensors.*NaN.*restore"):
        Trainer(part, resume=True, log_to_console=False).train()
