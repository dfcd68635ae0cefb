"""The GPUs the planner knows: memory, peak rates, bandwidths, and what was measured.

Every number is either a public datasheet value or a measurement on the project's own
machine (docs/assets.md), and says which. Times are peak rate x efficiency: the efficiency
defaults to the ratios we have measured (bf16 matmul on the H200: ~797 of 989 TFLOP/s;
row-wise FP8 on the H100: 0.57 of 1979), applied to every card until a finished run
calibrates it (`--calibrate`).

Units: GB = 1e9 bytes, TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 bytes/s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dflash_trainer.errors import DFlashError

GB_UNIT = 1e9

H200_MEASURED_MATMUL_EFFICIENCY = 797.0 / 989.0
"""bf16 8192^3 matmul on the project's H200 over its datasheet peak (docs/assets.md)."""
H100_MEASURED_FP8_EFFICIENCY = 0.57
"""Row-wise scaled FP8 matmuls at Qwen3.6-27B shapes (8,192 tokens) on the project's H100,
the per-token quantization's memory time taken out, over the 1979 TFLOP/s FP8 peak
(benchmarks/fp8_matmul_h100_202612.md)."""
H200_MEASURED_COPY_EFFICIENCY = 4.2 / 4.8
"""Device-to-device copy on the H200 (4.2 TB/s) over its datasheet HBM bandwidth."""


@dataclass(frozen=True)
class Hardware:
    """One GPU of a machine, plus the link between GPUs of the same host."""

    name: str
    memory_gb: float
    """Memory the planner fits against (the measured total where we have one)."""
    datasheet_memory_gb: float
    bf16_tflops: float
    """Dense bf16 tensor-core peak (datasheet, no sparsity)."""
    fp8_tflops: float
    """Dense FP8 peak (datasheet, no sparsity)."""
    bandwidth_gbs: float
    """Memory bandwidth (datasheet)."""
    link_gbs: float
    """GPU-to-GPU bandwidth per direction inside a host (NVLink or PCIe)."""
    link_kind: str
    matmul_efficiency: float = H200_MEASURED_MATMUL_EFFICIENCY
    """Achieved / peak for large bf16 matmuls."""
    fp8_matmul_efficiency: float = H100_MEASURED_FP8_EFFICIENCY
    """Achieved / peak for the FP8 target's row-wise scaled matmuls (measured on the H100,
    applied to every card until a measurement of its own)."""
    bandwidth_efficiency: float = H200_MEASURED_COPY_EFFICIENCY
    """Achieved / peak for memory-bound elementwise work."""
    link_efficiency: float = 0.7
    """Achieved / peak for collectives and copies between GPUs (not measured: an assumption)."""
    runtime_reserve_gb: float = 1.0
    """CUDA context, cuBLAS/NCCL workspaces and allocator slack not seen by tensors."""
    measured: tuple[str, ...] = ()
    """Which fields are measurements rather than datasheet values."""
    source: str = ""

    @property
    def fp8_efficiency(self) -> float:
        return self.fp8_matmul_efficiency

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["measured"] = list(self.measured)
        return d


PRESETS: dict[str, Hardware] = {
    "h200": Hardware(
        name="h200",
        memory_gb=143.0,
        datasheet_memory_gb=141.0,
        bf16_tflops=989.0,
        fp8_tflops=1979.0,
        bandwidth_gbs=4800.0,
        link_gbs=450.0,
        link_kind="NVLink 4 (900 GB/s bidirectional)",
        measured=("memory_gb", "matmul_efficiency", "bandwidth_efficiency"),
        source="NVIDIA H200 SXM datasheet; 143 GB, 797 TFLOP/s, 4.2 TB/s measured (docs/assets.md)",
    ),
    "h100": Hardware(
        name="h100",
        memory_gb=80.0,
        datasheet_memory_gb=80.0,
        bf16_tflops=989.0,
        fp8_tflops=1979.0,
        bandwidth_gbs=3350.0,
        link_gbs=450.0,
        link_kind="NVLink 4 (900 GB/s bidirectional)",
        measured=("fp8_matmul_efficiency",),
        source="NVIDIA H100 SXM datasheet; bf16 and copy efficiencies assumed equal to the "
        "H200's, FP8 efficiency measured (benchmarks/fp8_matmul_h100_202612.md)",
    ),
    "b200": Hardware(
        name="b200",
        memory_gb=180.0,
        datasheet_memory_gb=192.0,
        bf16_tflops=2250.0,
        fp8_tflops=4500.0,
        bandwidth_gbs=8000.0,
        link_gbs=900.0,
        link_kind="NVLink 5 (1.8 TB/s bidirectional)",
        source="NVIDIA DGX/HGX B200 (180 GB usable of 192); efficiencies assumed = H200's",
    ),
    "rtx-pro-6000": Hardware(
        name="rtx-pro-6000",
        memory_gb=96.0,
        datasheet_memory_gb=96.0,
        bf16_tflops=503.8,
        fp8_tflops=1007.6,
        bandwidth_gbs=1792.0,
        link_gbs=64.0,
        link_kind="PCIe 5.0 x16 (no NVLink)",
        source="RTX PRO 6000 Blackwell: 503.8 TFLOP/s bf16 and 1007.6 FP8 dense with fp32 "
        "accumulation (4 PFLOPS FP4 sparse / 8 and / 4), 1.79 TB/s GDDR7; efficiencies "
        "assumed equal to the H200's",
    ),
}


def hardware_names() -> list[str]:
    return [*sorted(PRESETS), "custom"]


def get_hardware(
    name: str,
    *,
    memory_gb: float | None = None,
    bf16_tflops: float | None = None,
    fp8_tflops: float | None = None,
    bandwidth_gbs: float | None = None,
    link_gbs: float | None = None,
    matmul_efficiency: float | None = None,
) -> Hardware:
    """A preset with optional overrides, or `custom` built from the overrides alone."""
    overrides = {
        "memory_gb": memory_gb,
        "bf16_tflops": bf16_tflops,
        "fp8_tflops": fp8_tflops,
        "bandwidth_gbs": bandwidth_gbs,
        "link_gbs": link_gbs,
        "matmul_efficiency": matmul_efficiency,
    }
    given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    for key, value in given.items():
        if value <= 0:
            raise DFlashError(f"--{key.replace('_', '-')}: must be > 0, got {value}")
    if name == "custom":
        missing = [k for k in ("memory_gb", "bf16_tflops", "bandwidth_gbs") if k not in given]
        if missing:
            flags = ", ".join("--" + k.replace("_", "-") for k in missing)
            raise DFlashError(f"--hardware custom needs {flags} (fp8 defaults to 2x bf16)")
        bf16 = given["bf16_tflops"]
        base = Hardware(
            name="custom",
            memory_gb=given["memory_gb"],
            datasheet_memory_gb=given["memory_gb"],
            bf16_tflops=bf16,
            fp8_tflops=given.get("fp8_tflops", 2 * bf16),
            bandwidth_gbs=given["bandwidth_gbs"],
            link_gbs=given.get("link_gbs", 64.0),
            link_kind="custom",
            source="command-line flags",
        )
        return dataclasses.replace(base, **given)
    if name not in PRESETS:
        raise DFlashError(f"--hardware {name!r}: unknown; choose one of {hardware_names()}")
    hw = PRESETS[name]
    if not given:
        return hw
    measured = tuple(m for m in hw.measured if m not in given)
    return dataclasses.replace(hw, **given, measured=measured, source=hw.source + " + flags")
