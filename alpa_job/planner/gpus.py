"""The GPUs a plan can target: memory, dense bf16 peak and NVLink bandwidth, or one the user describes."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from alpa_job.choices import not_known
from alpa_job.errors import KitError
from alpa_job.engines.flops import PEAK_BF16_FLOPS


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int  # what one card holds (the planner applies the kit's usable fraction)
    peak_flops: float  # dense bf16 matmul FLOP/s
    nvlink_bytes_s: float  # one GPU's NVLink bandwidth, one direction
    source: str  # where the numbers come from

    def describe(self) -> str:
        return (
            f"{self.name}: {self.memory_bytes / 1e9:.0f} GB, {self.peak_flops / 1e12:.0f} TFLOP/s bf16, "
            f"NVLink {self.nvlink_bytes_s / 1e9:.0f} GB/s"
        )


# H100 and H200 peaks are the rates measured on the lent machines (engines/flops.py), the ones the
# calibration runs' MFU used, so the fitted efficiency applies to them unchanged. A100's is the datasheet's.
# NVLink: one direction per GPU (H100/H200 NVLink 4: 900 GB/s both ways; A100 NVLink 3: 600).
CATALOGUE: Dict[str, Gpu] = {
    "h100": Gpu(
        "h100",
        80 * 10**9,
        PEAK_BF16_FLOPS["NVIDIA H100 80GB HBM3"],
        450e9,
        "H100 80GB HBM3: peak measured on the lent machine; NVLink datasheet",
    ),
    "h200": Gpu("h200", 141 * 10**9, PEAK_BF16_FLOPS["NVIDIA H200"], 450e9, "H200: peak measured on the lent machine; NVLink datasheet"),
    "a100": Gpu("a100", 80 * 10**9, 312e12, 300e9, "A100 80GB SXM: datasheet (not measured by the kit)"),
}

# The GPU the calibration's measured runs ran on, by jax's device_kind there.
DEVICE_KINDS = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200"}


def resolve(
    name: Optional[str], memory_gb: Optional[float] = None, tflops: Optional[float] = None, nvlink_gbps: Optional[float] = None
) -> Gpu:
    """A catalogue GPU with any of its numbers overridden, or (unknown name) one the flags describe fully."""
    given = {"--gpu-memory-gb": memory_gb, "--gpu-tflops": tflops, "--nvlink-gbps": nvlink_gbps}
    for flag, value in given.items():
        if value is not None and value <= 0:
            raise KitError(f"{flag} must be > 0, got {value}")
    key = (name or "h100").lower()
    base = CATALOGUE.get(key)
    if base is None:
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise KitError(not_known("--gpu", name, CATALOGUE) + f"; or describe it with {', '.join(missing)}")
        return Gpu(key, int(memory_gb * 1e9), tflops * 1e12, nvlink_gbps * 1e9, "described by the flags")
    if all(v is None for v in given.values()):
        return base
    return dataclasses.replace(
        base,
        memory_bytes=int(memory_gb * 1e9) if memory_gb else base.memory_bytes,
        peak_flops=tflops * 1e12 if tflops else base.peak_flops,
        nvlink_bytes_s=nvlink_gbps * 1e9 if nvlink_gbps else base.nvlink_bytes_s,
        source=base.source + "; overridden by the flags",
    )
