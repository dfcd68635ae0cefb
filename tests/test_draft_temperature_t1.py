"""benchmarks/draft_temperature_t1.py: the per-block expected tau it averages, on a tiny real
target and drafter (the trainer's own step code underneath)."""

from __future__ import annotations

import torch
from benchmark_scripts import load_benchmark
from trainer_utils import tiny_config

from dflash_trainer.data.shards import PreparedDataset
from dflash_trainer.train.step import settings_for_spec
from dflash_trainer.train.trainer import Trainer


def test_expected_tau_is_one_plus_the_summed_prefix_products():
    mod = load_benchmark("draft_temperature_t1")
    alpha = torch.tensor([[9.0, 0.5, 0.5, 1.0], [9.0, 0.0, 1.0, 1.0], [9.0, 1.0, 1.0, 1.0]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, True], [True] * 3 + [False]])
    real = torch.tensor([True, True, True])
    # Slot 0 (the anchor) never counts; a slot past the document's end accepts nothing.
    expected = torch.tensor([1 + 0.5 + 0.25 + 0.25, 1.0, 3.0])
    assert torch.allclose(mod.expected_tau(alpha, valid, real), expected)


def test_t0_acceptance_is_the_run_of_argmax_matches(tmp_path):
    """At t=0 each block accepts the leading slots whose drafter argmax is the target's: a
    whole number from 1 to the block size, where the t=1 values are fractions."""
    mod = load_benchmark("draft_temperature_t1")
    # lk: the step keeps the target's distribution at every slot, as the script's config does.
    cfg = tiny_config(tmp_path, training={"loss": "lk", "weighting": "decay"})
    tr = Trainer(cfg, log_to_console=False)
    st = settings_for_spec(cfg, tr.spec, fixed_shapes=False)
    data = PreparedDataset(cfg.data.train, "train")
    bench = load_benchmark("heldout_tau")
    _, docs = next(iter(bench.doc_batches(data, 8, 256)))
    with torch.no_grad():
        greedy, sampled, t0 = mod.block_overlaps(
            tr.drafter.float(), tr.target, docs, st, torch.Generator().manual_seed(0), [1.0]
        )
    assert t0.numel() == greedy.numel() == sampled[1.0].numel() > 0
    assert torch.equal(t0, t0.round())
    assert bool((t0 >= 1).all()) and bool((t0 <= tr.spec.block_size).all())
    assert bool((greedy >= 1).all()) and not torch.equal(greedy, greedy.round())
