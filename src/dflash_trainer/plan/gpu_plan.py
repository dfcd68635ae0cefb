"""Memory per GPU: the target's and the drafter's bytes (memory.py's ledgers) placed on
the cards by placement, against each card's capacity and runtime reserve.

pairs: a target GPU and a drafter GPU per rank; colocated: one GPU holds both models'
weights, while the target's forward transient and the drafter's step take turns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dflash_trainer.plan.hardware import GB_UNIT, Hardware
from dflash_trainer.plan.memory import DrafterMemory, TargetMemory


@dataclass(frozen=True)
class GpuPlan:
    role: str
    """target, drafter or colocated (both)."""
    capacity_gb: float
    peak_gb: float
    """Peak allocated bytes (what torch.cuda.max_memory_allocated reports)."""
    reserve_gb: float
    breakdown_gb: dict[str, float]
    unfused_peak_gb: float
    """The same GPU with compile off (CUDA SDPA math kernel, scores materialised)."""

    @property
    def headroom_gb(self) -> float:
        return self.capacity_gb - self.peak_gb - self.reserve_gb

    @property
    def fits(self) -> bool:
        return self.headroom_gb >= 0

    @property
    def unfused_fits(self) -> bool:
        return self.capacity_gb - self.unfused_peak_gb - self.reserve_gb >= 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(headroom_gb=self.headroom_gb, fits=self.fits, unfused_fits=self.unfused_fits)
        return d


def gpu_plans(
    hw: Hardware,
    placement: str,
    tmem: TargetMemory,
    dmem: DrafterMemory,
    dmem_unfused: DrafterMemory,
) -> list[GpuPlan]:
    g = GB_UNIT
    reserve = hw.runtime_reserve_gb
    if placement == "pairs":
        target = GpuPlan(
            "target",
            hw.memory_gb,
            tmem.peak / g,
            reserve,
            {"weights": tmem.weights / g, "forward + features": tmem.forward_peak / g},
            tmem.peak / g,
        )
        drafter = GpuPlan(
            "drafter",
            hw.memory_gb,
            dmem.peak / g,
            reserve,
            drafter_breakdown(dmem),
            dmem_unfused.peak / g,
        )
        return [target, drafter]
    # Colocated: weights stay; the target's transient and the drafter's step alternate.
    both = tmem.weights + max(tmem.forward_peak, dmem.peak)
    both_unfused = tmem.weights + max(tmem.forward_peak, dmem_unfused.peak)
    breakdown = {
        "target weights": tmem.weights / g,
        "target forward + features": tmem.forward_peak / g,
    }
    breakdown.update(drafter_breakdown(dmem))
    return [GpuPlan("colocated", hw.memory_gb, both / g, reserve, breakdown, both_unfused / g)]


def drafter_breakdown(dmem: DrafterMemory) -> dict[str, float]:
    g = GB_UNIT
    out = {k: v / g for k, v in dmem.static.items()}
    out.update({f"input {k}": v / g for k, v in dmem.inputs.items() if v})
    out["activations (saved)"] = dmem.activation_bytes / g
    peak_phase = max(dmem.phases, key=lambda k: dmem.phases[k])
    out[f"peak phase: {peak_phase}"] = dmem.peak / g
    return out
