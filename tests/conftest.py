"""Shared fixtures: tiny real drafter specs and packs built in code."""

from __future__ import annotations

import os

import pytest
import torch
from lineage_chain import Chain, build_chain

from dflash_trainer.core.geometry import DrafterSpec


def make_spec(
    hidden: int = 64,
    vocab: int = 97,
    layers: int = 2,
    block: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    layer_types: tuple[str, ...] | None = None,
    window: int | None = None,
    n_tapped: int = 3,
    **extra: object,
) -> DrafterSpec:
    return DrafterSpec(
        hidden_size=hidden,
        vocab_size=vocab,
        target_hidden_size=hidden,
        num_target_hidden_layers=8,
        target_layer_ids=tuple(range(1, 1 + 2 * n_tapped, 2)),
        block_size=block,
        mask_token_id=vocab - 1,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=2 * hidden,
        rope_theta=10000.0,
        layer_types=layer_types or ("full_attention",) * layers,
        sliding_window=window,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        **extra,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="session", autouse=True)
def gguf_cache_dir(tmp_path_factory):
    """The tests' own GGUF cache (dflash_trainer.gguf_cache), shared by every test of the session
    and the commands they start: tests never write the user's cache, and never read one that a
    different version of the code wrote."""
    from dflash_trainer import gguf_cache

    before = os.environ.get(gguf_cache.ENV)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one for all the run's workers: built once
        root = tmp_path_factory.getbasetemp().parent / "gguf-cache"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("gguf-cache")
    os.environ[gguf_cache.ENV] = str(root)
    yield
    if before is None:
        os.environ.pop(gguf_cache.ENV, None)
    else:
        os.environ[gguf_cache.ENV] = before


@pytest.fixture
def one_thread():
    """One torch thread: tiny models are pure Python overhead, and two threads on two shared
    cores only contend. Modules of such tests set `pytestmark = pytest.mark.usefixtures(...)`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def spec() -> DrafterSpec:
    return make_spec(layers=2, layer_types=("sliding_attention", "full_attention"), window=3)


def random_docs(
    lengths: list[int], vocab: int = 90, p_mask: float = 0.7, seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    masks = [torch.rand(n, generator=g) < p_mask for n in lengths]
    return ids, masks


def pytest_configure(config: pytest.Config) -> None:
    """With parallel workers (pytest -n N) each takes its share of the cores for torch: N
    workers of all the cores each would only contend."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Modules with a slow test first (whole: their module fixtures are built once): run in
    # parallel, the last minutes then hold many short tests to share among the workers, not
    # one long one that keeps the others idle. The sort is stable: file order otherwise.
    slow = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    """Three real continuations of a tiny drafter (tests/lineage_chain.py), once per module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the module fixture runs before the per-test one
    try:
        return build_chain(tmp_path_factory.mktemp("lineage"))
    finally:
        torch.set_num_threads(before)
