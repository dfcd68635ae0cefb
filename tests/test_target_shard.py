"""The frozen target sharded over ranks (distributed.target_sharding=fsdp), on CPU with
gloo and 2 processes, and device_map's refusals where there is no CUDA.

The sharded target is checked against an unsharded copy of the same weights on the
same rank's documents, with ranks whose documents group into different numbers of
target micro-batches (every forward is a collective: a rank that made fewer would
hang the other). A rank that hangs anyway fails the test by its timeout.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks
from safetensors.torch import load_file
from trainer_utils import tiny_config, write_tiny_target

from dflash_trainer.config import ConfigError, DistributedConfig, TargetConfig
from dflash_trainer.errors import DFlashError
from dflash_trainer.target.model import FrozenTarget, load_target_model, spread_over_gpus
from dflash_trainer.train.batching import Position, TokenBudgetBatcher
from dflash_trainer.train.dataset import load_train_data
from dflash_trainer.train.distributed import World, apply_target_sharding
from dflash_trainer.train.step import _micro_batches, settings_from_config
from dflash_trainer.train.trainer import Trainer

TIMEOUT_S = 240

# Per rank: documents and the micro-batch budget, so rank 0 runs 3 target forwards
# and rank 1 one (checked in the worker).
FORWARD_WORKER = textwrap.dedent(
    """
    import copy, dataclasses, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import torch
    from torch.distributed.tensor import DTensor
    from trainer_utils import tiny_config
    from dflash_trainer.train import distributed as D
    from dflash_trainer.plan.flops import describe_target
    from dflash_trainer.plan.memory import target_memory
    from dflash_trainer.train.step import _micro_batches, run_target, settings_from_config
    from dflash_trainer.target.model import FrozenTarget, decoder_layers, load_target_model
    from dflash_trainer.plan.workload import StepShape

    tmp = Path(sys.argv[1])
    cfg = tiny_config(tmp, distributed={{"target_sharding": "fsdp"}})
    world = D.init_world(cfg.distributed, "cpu")
    model = load_target_model(cfg.target, D.target_load_device(cfg.distributed, world))
    reference = FrozenTarget(copy.deepcopy(model), [0, 2])
    assert D.apply_target_sharding(model, cfg.distributed, world)
    sharded = FrozenTarget(model, [0, 2])
    assert sharded.sharded and not reference.sharded

    gen = torch.Generator().manual_seed(100 + world.rank)
    lengths = [[5, 30, 60, 90], [10, 12]][world.rank]
    docs = [(torch.randint(0, 62, (n,), generator=gen), torch.ones(n, dtype=torch.bool))
            for n in lengths]
    budget = 100
    assert len(_micro_batches(lengths, budget)) == [3, 1][world.rank]
    base = settings_from_config(cfg, 63, False)
    tight = dict(rtol=1e-6, atol=1e-6)
    for labels in ("target", "data"):
        st = dataclasses.replace(base, labels=labels, target_batch_tokens=budget)
        got, want = run_target(sharded, docs, st), run_target(reference, docs, st)
        torch.testing.assert_close(got.features_TF, want.features_TF, **tight)
        if labels == "target":
            torch.testing.assert_close(got.final_hidden_TH, want.final_hidden_TH, **tight)
            assert torch.equal(
                sharded.argmax_at(got.final_hidden_TH), reference.argmax_at(want.final_hidden_TH)
            )
        else:
            assert got.final_hidden_TH is None

    # What the drafter reads stays whole (and equal); the layers are split in two.
    assert torch.equal(sharded.lm_head_weight, reference.lm_head_weight)
    ids = torch.arange(62)
    assert torch.equal(sharded.embed(ids), reference.embed(ids))
    assert not isinstance(sharded.lm_head_weight, DTensor)
    assert not isinstance(sharded.embed_tokens.weight, DTensor)

    def elements(m):
        return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                   for p in m.parameters())

    full_layers = elements(decoder_layers(reference.model))
    local_layers = elements(decoder_layers(model))
    assert all(isinstance(p, DTensor) for p in decoder_layers(model).parameters())
    assert abs(local_layers - full_layers / 2) <= 0.01 * full_layers, (local_layers, full_layers)
    # The planner's bytes per GPU (bf16: 2 bytes per element) bound the measured
    # storage and are close to it (it counts the layers' norms as whole).
    shape = StepShape(1, 1, 1, 1, 1, 1, 128, 1, 4, 1)
    planned = target_memory(describe_target(model.config), shape, 2, False, 1, True, shards=2)
    local = elements(model)
    assert local <= planned.weights / 2 <= 1.02 * local, (local, planned.weights / 2)
    print("RANK_OK", world.rank, local, elements(reference.model), flush=True)
    D.shutdown(world)
    """
)

TRAIN_WORKER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from trainer_utils import tiny_config
    from dflash_trainer.train.trainer import Trainer

    tmp, sharding, parallel, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    name = f"run-{{sharding}}-{{parallel}}"
    cfg = tiny_config(
        tmp,
        distributed={{"target_sharding": sharding, "data_parallel": parallel}},
        data={{"max_doc_tokens": 128}},
        run={{"output_dir": str(tmp / name)}},
        training={{"max_steps": steps, "checkpoint_every": 100, "log_every": 1}},
    )
    tr = Trainer(cfg, log_to_console=False)
    assert tr.target.sharded == (sharding == "fsdp")
    tr.train()
    """
)


def _launch(tmp: Path, script_text: str, args: list[str], world: int = 2) -> list[str]:
    """Run `script_text` as `world` gloo ranks; their outputs, or a failure naming a hang."""
    # The tiny target and data are written here, once, not by the ranks at the same time.
    tiny_config(tmp)
    script = tmp / f"worker_{abs(hash(script_text))}.py"
    script.write_text(script_text.format(tests=str(Path(__file__).parent)))
    rcs, outs = run_ranks(script, [str(tmp), *args], world, TIMEOUT_S)
    assert rcs == [0] * world, "\n".join(outs)
    return outs


@pytest.mark.slow
def test_sharded_target_equals_the_whole_one_with_uneven_micro_batches(tmp_path):
    outs = _launch(tmp_path, FORWARD_WORKER, [])
    assert all("RANK_OK" in out for out in outs), "\n".join(outs)


def _micro_batch_counts(tmp: Path, steps: int) -> list[tuple[int, int]]:
    """Target micro-batches of (rank 0, rank 1) in each of the first steps of the run."""
    cfg = tiny_config(tmp, data={"max_doc_tokens": 128})
    data = load_train_data(cfg, tmp / "probe", True)
    st = settings_from_config(cfg, cfg.drafter.mask_token_id or 0, False)
    counts = []
    batchers = [
        TokenBudgetBatcher(data.train.lengths, cfg.data.token_budget, cfg.data.doc_limit, 0, r, 2)
        for r in (0, 1)
    ]
    pos = Position()
    for _ in range(steps):
        per_rank = []
        for b in batchers:
            lengths = [
                min(int(data.train.lengths[i]), cfg.data.doc_limit) for i in b.documents(pos)
            ]
            per_rank.append(len(_micro_batches(lengths, st.target_batch_tokens)))
        counts.append((per_rank[0], per_rank[1]))
        pos = batchers[0].advance(pos)
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_the_same_drafter_with_a_sharded_target(tmp_path, parallel):
    steps = 3
    # The runs must include a step where the ranks make different numbers of target
    # micro-batches, or the padding of forwards is never exercised.
    counts = _micro_batch_counts(tmp_path, steps)
    assert any(a != b for a, b in counts), counts
    _launch(tmp_path, TRAIN_WORKER, ["replicate", parallel, str(steps)])
    _launch(tmp_path, TRAIN_WORKER, ["fsdp", parallel, str(steps)])
    ref = load_file(str(tmp_path / f"run-replicate-{parallel}" / "drafter" / "drafter.safetensors"))
    got = load_file(str(tmp_path / f"run-fsdp-{parallel}" / "drafter" / "drafter.safetensors"))
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=2e-5, rtol=2e-4, msg=k)


def test_fsdp_target_with_one_rank_stays_whole(tmp_path):
    model = load_target_model(
        TargetConfig(name_or_path=str(write_tiny_target(tmp_path / "t")), dtype="float32")
    )
    assert not apply_target_sharding(model, DistributedConfig(target_sharding="fsdp"), World())
    assert not FrozenTarget(model, [0, 2]).sharded


def test_fsdp_target_needs_colocated():
    with pytest.raises(ConfigError, match=r"distributed\.target_sharding: fsdp needs placement"):
        DistributedConfig(target_sharding="fsdp", placement="pairs")


def test_device_map_without_cuda_names_the_field_and_the_fix(tmp_path):
    cfg = tiny_config(tmp_path, distributed={"target_sharding": "device_map"})
    with pytest.raises(DFlashError) as e:
        Trainer(cfg, log_to_console=False)
    msg = str(e.value)
    assert "distributed.target_sharding=device_map" in msg and "no CUDA device" in msg
    assert "target_sharding=replicate" in msg and "fsdp under torchrun" in msg


def test_device_map_refuses_a_target_larger_than_the_gpus(tmp_path):
    model = load_target_model(
        TargetConfig(name_or_path=str(write_tiny_target(tmp_path / "t")), dtype="float32")
    )
    # 20 kB per GPU for a 165 kB target: accelerate would offload it, which we refuse.
    with pytest.raises(DFlashError, match="does not fit the GPUs"):
        spread_over_gpus(model, {0: 20_000, 1: 20_000})
