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

Each rank compiles into its own Inductor/Triton cache directory, and ranks warm up
one at a time (a barrier per rank), so no two processes or threads ever write one
cache or share one autotuner (the seed's crash).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
        torch.cuda.set_device(ddev)
    else:
        if device.startswith("cuda"):
            raise DFlashError("no CUDA device")
        tdev = ddev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend=backend, device_id=ddev if use_cuda else None)
    return World(rank, world_size, local_rank, tdev, ddev)


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
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
