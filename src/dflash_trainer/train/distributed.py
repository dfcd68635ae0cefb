"""torchrun ranks, device placement and data parallelism.

Placement (docs/multi-gpu.md):
- colocated: rank r uses one GPU for both the target and the drafter;
- pairs: rank r owns two GPUs, the target on the first and the drafter on the second.
  The trainer runs the target forward of step i+1 on the target GPU (its own CUDA
  stream, issued before the drafter step i) so both GPUs stay busy.

Data parallelism is torch's own (DDP by default, FSDP2 `fully_shard` per drafter
layer for drafters too large to replicate). Gradients are averaged by supervised
slot weight, not by rank: each rank scales its loss by world * local / global weight
before DDP's mean, so a rank with few supervised tokens does not count as much as a
full one.

The frozen target (`distributed.target_sharding`) is replicated by default. `fsdp`
shards each of its decoder layers over the ranks (FSDP2, all-gathered one layer at a
time in the forward) for targets too large for one GPU; `device_map` spreads one
process's target over the GPUs it owns (accelerate), for a single process or pairs.

Each rank compiles into its own Inductor/Triton cache directory, and ranks warm up
one at a time (a barrier per rank), so no two processes or threads ever write one
cache or share one autotuner: two threads sharing an FLA/Triton autotuner or one Triton
cache crash or corrupt it (docs/multi-gpu.md).
"""

from __future__ import annotations

import atexit
import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dflash_trainer.config import DistributedConfig
from dflash_trainer.errors import DFlashError


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    target_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    drafter_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    target_gpus: tuple[int, ...] = ()
    """GPUs the target is spread over (target_sharding=device_map only)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_world(dcfg: DistributedConfig, device: str = "auto") -> World:
    """Read torchrun's environment, pick devices, start the process group."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise DFlashError("training.device=cuda but no CUDA device is visible")
    if dcfg.target_sharding == "device_map" and not use_cuda:
        raise DFlashError(
            "distributed.target_sharding=device_map spreads the target over several GPUs, "
            "but this run has no CUDA device; use distributed.target_sharding=replicate "
            "(one copy per rank), or fsdp under torchrun to shard it over the ranks"
        )
    target_gpus: tuple[int, ...] = ()
    if use_cuda:
        n_gpu = torch.cuda.device_count()
        per_rank = 2 if dcfg.placement == "pairs" else 1
        first = local_rank * per_rank
        if dcfg.placement == "pairs" and n_gpu == 1 and world_size == 1:
            # A degenerate pair (both roles on one GPU) for correctness checks.
            tdev = ddev = torch.device("cuda:0")
        else:
            if first + per_rank > n_gpu:
                raise DFlashError(
                    f"distributed.placement={dcfg.placement} needs {per_rank} GPU(s) per rank: "
                    f"local rank {local_rank} wants cuda:{first}..{first + per_rank - 1} but "
                    f"only {n_gpu} are visible; lower --nproc-per-node or use colocated"
                )
            tdev = torch.device(f"cuda:{first}")
            ddev = torch.device(f"cuda:{first + per_rank - 1}")
        if dcfg.target_sharding == "device_map":
            target_gpus = _device_map_gpus(dcfg, world_size, first, per_rank, n_gpu)
        torch.cuda.set_device(ddev)
    else:
        if device.startswith("cuda"):
            raise DFlashError("no CUDA device")
        tdev = ddev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend=backend, device_id=ddev if use_cuda else None)
        # A process group still alive at interpreter exit lets gloo's worker threads be
        # torn down while joinable, which aborts the rank ("terminate called without an
        # active exception", exit -6) after a successful run: always close it on exit.
        atexit.register(_close_group)
    return World(rank, world_size, local_rank, tdev, ddev, target_gpus)


def _device_map_gpus(
    dcfg: DistributedConfig, world_size: int, first: int, per_rank: int, n_gpu: int
) -> tuple[int, ...]:
    """The GPUs this rank owns: every visible one for a single process, else its own."""
    gpus = tuple(range(n_gpu)) if world_size == 1 else tuple(range(first, first + per_rank))
    if len(gpus) < 2:
        raise DFlashError(
            f"distributed.target_sharding=device_map: this rank owns {len(gpus)} GPU "
            f"(placement={dcfg.placement}, {world_size} rank(s), {n_gpu} visible), nothing "
            "to spread the target over; use target_sharding=fsdp under torchrun (shards it "
            "over the ranks), or one process with several visible GPUs"
        )
    return gpus


# Share of each GPU's memory the target's weights may take under device_map: headroom
# for its no-grad forward (one layer's activations) and the CUDA context; on the
# drafter's own GPU half, the rest being the drafter step's.
_DEVICE_MAP_SHARE = 0.9
_DEVICE_MAP_DRAFTER_SHARE = 0.5


def target_max_memory(dcfg: DistributedConfig, world: World) -> dict[int, int] | None:
    """device_map: bytes of target weights allowed per GPU; None when not spreading."""
    if dcfg.target_sharding != "device_map":
        return None
    assert world.target_gpus, "init_world sets target_gpus for device_map"
    out = {}
    for i in world.target_gpus:
        share = _DEVICE_MAP_DRAFTER_SHARE if i == world.drafter_device.index else _DEVICE_MAP_SHARE
        out[i] = int(share * torch.cuda.get_device_properties(i).total_memory)
    return out


def target_load_device(dcfg: DistributedConfig, world: World) -> torch.device:
    """Where the target is loaded: on the host when it is sharded next, so no GPU ever
    holds it whole (fully_shard moves one layer at a time and keeps 1/world of it)."""
    if dcfg.target_sharding == "fsdp" and world.distributed:
        return torch.device("cpu")
    return world.target_device


def apply_target_sharding(model: nn.Module, dcfg: DistributedConfig, world: World) -> bool:
    """target_sharding=fsdp: each rank keeps 1/world of every decoder layer of the target.

    In this order: the parts kept whole go to the target device; `fully_shard` each
    decoder layer with reshard_after_forward=True (a layer is all-gathered just before
    it runs and freed right after, so about two whole layers are resident at once);
    then `fully_shard` the decoder, the module the forward enters, as the FSDP root
    that orders the layers' all-gathers.

    Kept whole on every rank: the embeddings, the final norm and lm_head (and anything
    else outside the layers). The drafter reads the full embedding table and lm_head
    every step (block embeddings, the loss), so each rank needs a whole copy anyway:
    sharding them would only add an all-gather per use, or a gathered copy of the same
    size. With one rank there is nothing to shard over: the target stays whole, as with
    replicate. Returns whether it was sharded.
    """
    if dcfg.target_sharding != "fsdp" or not world.distributed:
        return False
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dflash_trainer.target.model import decoder_layers, decoder_of

    layers = decoder_layers(model)
    decoder = decoder_of(model)
    in_layers = {id(t) for t in itertools.chain(layers.parameters(), layers.buffers())}
    whole = [p for p in model.parameters() if id(p) not in in_layers]
    for t in itertools.chain(whole, model.buffers()):
        if id(t) not in in_layers:
            t.data = t.data.to(world.target_device)
    # An explicit mesh on the target's device type: FSDP's default follows the visible
    # accelerator, a CUDA mesh even for a CPU (gloo) run on a machine with a GPU.
    mesh = init_device_mesh(world.target_device.type, (world.world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True, ignored_params=set(whole))
    return True


def set_compile_cache(run_dir: Path, rank: int) -> Path:
    """One Inductor + Triton cache directory per rank, under the run directory."""
    root = run_dir / "compile_cache" / f"rank{rank}"
    (root / "triton").mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    return root


@contextmanager
def one_rank_at_a_time(world: World) -> Iterator[None]:
    """Run the body on rank 0, then rank 1, ... (ordered compile warm-up)."""
    if not world.distributed:
        yield
        return
    for r in range(world.world_size):
        if r == world.rank:
            yield
        dist.barrier()


def all_reduce_sum(x: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def broadcast_object(obj: object, world: World) -> object:
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wrap_data_parallel(model: nn.Module, dcfg: DistributedConfig, world: World) -> nn.Module:
    """DDP (replicated drafter) or FSDP2 (fully_shard each layer, then the root)."""
    if not world.distributed:
        return model
    if dcfg.data_parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        layers = getattr(model, "layers", [])
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [world.drafter_device.index] if world.drafter_device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def shutdown(world: World) -> None:
    if world.distributed:
        _close_group()


def _close_group() -> None:
    """Close the process group once every rank got here.

    Closing alone was not enough: a gloo rank that tears down its connections while a peer
    is still tearing down its own can abort that peer at exit (exit -6, seen in CI). So the
    ranks meet first. A peer that died makes the barrier time out; the group is closed
    anyway.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=30))
        except RuntimeError:
            pass
    dist.destroy_process_group()
