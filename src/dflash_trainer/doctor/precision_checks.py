"""The doctor's check of the target's matmul precision: an FP8 target (`target.precision:
fp8`) needs a CUDA GPU of compute capability 8.9 or newer and a PyTorch whose scaled FP8
matmul runs there (target/fp8.py). The capability is checked on this machine's GPU when it
has one (the loader then probes the matmul itself), else the planned card is named, else
it is left as a warning.
"""

from __future__ import annotations

from dflash_trainer.config import Config
from dflash_trainer.doctor.report import Check
from dflash_trainer.errors import DFlashError
from dflash_trainer.plan.hardware import Hardware

_FIX = "run on an Ada, Hopper or Blackwell GPU, or set target.precision=bf16"


def check_target_precision(cfg: Config, hardware: Hardware | None, cuda: bool) -> list[Check]:
    """`cuda`: this machine has a CUDA GPU (the one the run would use is probed)."""
    if cfg.target.precision != "fp8":
        return [Check("target.precision", "pass", "bf16 target (target.precision=bf16)")]
    if cuda:
        import torch

        from dflash_trainer.target.fp8 import check_fp8_device

        # The compute capability only: a probe matmul would open a CUDA context on this GPU
        # in every rank; the loader probes the target's own GPU.
        dev = cfg.training.device if cfg.training.device.startswith("cuda:") else "cuda:0"
        try:
            check_fp8_device(dev)
        except DFlashError as e:
            return [Check("target.precision", "fail", str(e), _FIX)]
        name = torch.cuda.get_device_name(torch.device(dev))
        cap = ".".join(map(str, torch.cuda.get_device_capability(torch.device(dev))))
        return [
            Check(
                "target.precision",
                "pass",
                f"fp8 target: {name} (compute capability {cap}) has FP8 tensor cores; the "
                "scaled matmul is probed when the target loads",
            )
        ]
    if hardware is not None:
        return [
            Check(
                "target.precision",
                "pass",
                f"fp8 target planned on {hardware.name} ({hardware.fp8_tflops:g} TFLOP/s dense "
                "FP8); the GPU itself is checked when the target loads",
            )
        ]
    return [
        Check(
            "target.precision",
            "warn",
            "target.precision=fp8 needs a CUDA GPU of compute capability 8.9 or newer, and this "
            "machine has none: the run will be refused here",
            _FIX,
        )
    ]
