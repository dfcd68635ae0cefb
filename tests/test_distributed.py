"""Data parallelism on CPU with gloo and 2 processes: DDP and FSDP2 equal one process."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks
from safetensors.torch import load_file
from trainer_utils import tiny_config

from dflash_trainer.core.dflash2 import serving_state
from dflash_trainer.train.batching import Position, TokenBudgetBatcher
from dflash_trainer.train.trainer import Trainer

WORKER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from trainer_utils import tiny_config
    from dflash_trainer.train.trainer import Trainer
    from dflash_trainer.errors import DFlashError
    tmp, parallel, steps, resume = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    drafter = json.loads(sys.argv[5])
    cfg = tiny_config(tmp, distributed={{"data_parallel": parallel}}, drafter=drafter,
                      run={{"output_dir": str(tmp / ("run-" + parallel))}},
                      training={{"max_steps": steps, "checkpoint_every": 2, "log_every": 1}})
    try:
        tr = Trainer(cfg, resume=resume, log_to_console=False)
    except DFlashError as e:
        print("DFLASH_ERROR", e)
        sys.exit(7)
    tr.train()
    """
)


DFLASH2 = {"kind": "dflash2", "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}


def _launch(
    tmp: Path,
    parallel: str,
    steps: int,
    world: int = 2,
    resume: bool = False,
    drafter: dict | None = None,
):
    # Write the tiny target and data here, once: two ranks writing them into one
    # folder at the same time race (a rank may read the other's half-written file).
    tiny_config(tmp)
    script = tmp / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parent)))
    args = [str(tmp), parallel, str(steps), "1" if resume else "0", json.dumps(drafter or {})]
    return run_ranks(script, args, world, timeout_s=300)


def _single_process_reference(
    tmp: Path, steps: int, drafter: dict | None = None
) -> dict[str, torch.Tensor]:
    # Same global batch: one process consumes both ranks' documents as 2 micro-steps.
    cfg = tiny_config(
        tmp,
        drafter=drafter or {},
        run={"output_dir": str(tmp / "single")},
        training={"max_steps": steps, "grad_accum_steps": 2, "checkpoint_every": 100},
    )
    tr = Trainer(cfg, log_to_console=False)
    tr.train()
    # As the drafter file holds it (embedding-mode selector factors made into tables).
    state, _ = serving_state(tr.drafter.state_dict(), tr.drafter.candidate_selector)
    return {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dflash2-embedding"])
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path, parallel, kind):
    drafter = {
        "dflash": None,
        "dflash2": DFLASH2,
        "dflash2-embedding": {**DFLASH2, "selector_codebooks": "embedding"},
    }[kind]
    rcs, outs = _launch(tmp_path, parallel, steps=3, drafter=drafter)
    assert rcs == [0, 0], "\n".join(outs)
    ref = _single_process_reference(tmp_path, steps=3, drafter=drafter)
    got = load_file(str(tmp_path / f"run-{parallel}" / "drafter" / "drafter.safetensors"))
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=2e-5, rtol=2e-4, msg=k)


@pytest.mark.slow
def test_resume_with_two_ranks_and_refusal_with_one(tmp_path):
    rcs, outs = _launch(tmp_path, "ddp", steps=2)
    assert rcs == [0, 0], "\n".join(outs)
    state = json.loads(
        (tmp_path / "run-ddp" / "checkpoints" / "step_00000002" / "trainer_state.json").read_text()
    )
    assert state["world_size"] == 2
    rcs, outs = _launch(tmp_path, "ddp", steps=4, resume=True)
    assert rcs == [0, 0], "\n".join(outs)
    rcs, outs = _launch(tmp_path, "ddp", steps=6, world=1, resume=True)
    assert rcs == [7] and "written by a run with 2 ranks; this run has 1" in outs[0]


def test_ranks_see_disjoint_documents():
    lengths = [30 + (i * 7) % 50 for i in range(200)]
    b0 = TokenBudgetBatcher(lengths, 256, 256, seed=3, rank=0, world_size=2)
    b1 = TokenBudgetBatcher(lengths, 256, 256, seed=3, rank=1, world_size=2)
    one = TokenBudgetBatcher(lengths, 256, 256, seed=3)
    seen0, seen1 = set(), set()
    pos = Position()
    for _ in range(b0.steps_per_epoch):
        d0, d1 = b0.documents(pos), b1.documents(pos)
        assert not set(d0) & set(d1)
        # Rank r's step s is step 2s + r of the single-process order.
        assert d0 == one.documents(Position(0, 2 * pos.step))
        assert d1 == one.documents(Position(0, 2 * pos.step + 1))
        seen0 |= set(d0)
        seen1 |= set(d1)
        pos = b0.advance(pos)
    assert not seen0 & seen1
