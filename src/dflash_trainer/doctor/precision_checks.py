"""The doctor's check of the target's matmul precision: an FP8 target (`target.precision:
fp8`) needs a CUDA GPU of compute capability 8.9 or newer and a PyTorch whose scaled FP8
matmul runs there (target/fp8.py). Checked on this machine's GPU when it has one (the same
probe the loader runs), else against the planned card, else left as a warning.
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

        from dflash_trainer.target.fp8 import fp8_mode

        dev = cfg.training.device if cfg.training.device.startswith("cuda") else "cuda"
        try:
            mode = fp8_mode(dev)
        except DFlashError as e:
            return [Check("target.precision", "fail", str(e), _FIX)]
        name = torch.cuda.get_device_name(torch.device(dev))
        return [
            Check(
                "target.precision",
                "pass",
                f"fp8 target: {name} runs {mode} scaled FP8 matmuls (the target's linears are "
                "quantized when it loads)",
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
