"""The GPUs a plan can target: memory, dense bf16 peak and NVLink bandwidth, from the catalogue, a GPU profile
(`plan calibrate`, gpu_profile.py) or the user's flags."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from alpa_job.choices import not_known
from alpa_job.errors import KitError
from alpa_job.engines.flops import PEAK_BF16_FLOPS
from alpa_job.planner import gpu_profile


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int  # what one card holds (the planner applies the kit's usable fraction)
    peak_flops: float  # dense bf16 matmul FLOP/s
    nvlink_bytes_s: float  # one GPU's NVLink bandwidth, one direction
    source: str  # where the numbers come from
    hbm_bytes_s: Optional[float] = None  # memory bandwidth (a profile's measured one, else the datasheet's)
    launch_s: Optional[float] = None  # one more kernel inside a compiled program (a profile's)
    profile: Optional[str] = None  # the GPU profile (plan calibrate) the numbers come from
    measured: Optional[Dict[str, Any]] = dataclasses.field(default=None, compare=False, repr=False)  # that profile

    def describe(self) -> str:
        hbm = f", HBM {self.hbm_bytes_s / 1e9:.0f} GB/s" if self.hbm_bytes_s else ""
        return (
            f"{self.name}: {self.memory_bytes / 1e9:.0f} GB, {self.peak_flops / 1e12:.0f} TFLOP/s bf16, "
            f"NVLink {self.nvlink_bytes_s / 1e9:.0f} GB/s{hbm}"
        )


# The datasheets': memory, HBM bandwidth, NVLink one direction per GPU (H100/H200 NVLink 4: 900 GB/s both
# ways; A100 NVLink 3: 600). The bf16 peaks of H100 and H200 are the rates measured on the lent machines
# (engines/flops.py), replaced below by the shipped H200 profile's where it exists. A100's is the datasheet's.
DATASHEET: Dict[str, Gpu] = {
    "h100": Gpu(
        "h100",
        80 * 10**9,
        PEAK_BF16_FLOPS["NVIDIA H100 80GB HBM3"],
        450e9,
        "H100 80GB HBM3: peak measured on the lent machine; NVLink datasheet",
        hbm_bytes_s=3.35e12,
    ),
    "h200": Gpu(
        "h200",
        141 * 10**9,
        PEAK_BF16_FLOPS["NVIDIA H200"],
        450e9,
        "H200: peak measured on the lent machine; NVLink datasheet",
        hbm_bytes_s=4.8e12,
    ),
    "a100": Gpu("a100", 80 * 10**9, 312e12, 300e9, "A100 80GB SXM: datasheet (not measured by the kit)", hbm_bytes_s=2.0e12),
}

# The GPU the calibration's measured runs ran on, by jax's device_kind there.
DEVICE_KINDS = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200"}


def from_profile(profile: Dict[str, Any], where: str, name: str, base: Optional[Gpu]) -> Gpu:
    """A GPU of a profile's measured numbers; memory (and NVLink, when one device was measured) from `base`,
    None where neither has it. The profile's platform must be a GPU's."""
    if profile["platform"] != "gpu":
        raise KitError(
            f"the GPU profile {where} was measured on {profile['device_kind']!r} ({profile['platform']}), "
            "not a GPU: run "
            "python -m alpa_job plan calibrate on a machine with the GPU you plan for"
        )
    bus = profile["collective_busbw"].get("all-reduce")
    if bus and bus["devices"] > 1:
        nvlink, link_how = bus["busbw_bytes_s"], f"NVLink = all-reduce bus bandwidth over {bus['devices']} GPUs"
    else:
        nvlink = base.nvlink_bytes_s if base else None
        link_how = "NVLink from the catalogue (one GPU measured)" if base else "no NVLink measured (one GPU)"
    memory = base.memory_bytes if base else profile.get("memory_bytes")
    source = (
        f"GPU profile {where}: {profile['device_kind']}, measured {profile['created']} (jax "
        f"{profile['versions']['jax']}): bf16 matmul {profile['peak_flops']['bf16'] / 1e12:.0f} TFLOP/s, HBM "
        f"{profile['hbm']['bytes_s'] / 1e9:.0f} GB/s, {profile['launch']['kernel_seconds'] * 1e6:.1f} us a "
        f"kernel; {link_how}"
    )
    return Gpu(
        name,
        memory,
        profile["peak_flops"]["bf16"],
        nvlink,
        source,
        hbm_bytes_s=profile["hbm"]["bytes_s"],
        launch_s=profile["launch"]["kernel_seconds"],
        profile=where,
        measured=profile,
    )


def _catalogue() -> Dict[str, Gpu]:
    """The datasheet's GPUs, H200 (and H100, the same GH100 compute by the datasheet) from the shipped H200
    profile when the kit ships one (profiles/h200.json, written by plan calibrate on a lent H200)."""
    out = dict(DATASHEET)
    if gpu_profile.has_shipped("h200"):
        where = "profiles/h200.json (shipped)"
        h200 = from_profile(gpu_profile.shipped("h200"), where, "h200", DATASHEET["h200"])
        out["h200"] = h200
        out["h100"] = dataclasses.replace(
            DATASHEET["h100"],
            peak_flops=h200.peak_flops,
            launch_s=h200.launch_s,
            measured=h200.measured,
            # the measured H200 HBM scaled by the datasheets' ratio
            hbm_bytes_s=h200.hbm_bytes_s * DATASHEET["h100"].hbm_bytes_s / DATASHEET["h200"].hbm_bytes_s,
            source=f"H100 80GB HBM3: not measured by plan calibrate (no H100 lent); bf16 matmul rate of {where} "
            f"({h200.peak_flops / 1e12:.0f} TFLOP/s: the same GH100 compute by the datasheet), its matmul grid, "
            "launch and collectives; HBM its measured figure x the datasheets' H100/H200 ratio; memory and NVLink "
            "datasheet",
        )
    return out


CATALOGUE: Dict[str, Gpu] = _catalogue()


def resolve(
    name: Optional[str],
    memory_gb: Optional[float] = None,
    tflops: Optional[float] = None,
    nvlink_gbps: Optional[float] = None,
    profile_path: Optional[str] = None,
) -> Gpu:
    """A catalogue GPU (or one measured by a GPU profile) with any of its numbers overridden, or (unknown
    name, no profile) one the flags describe fully."""
    given = {"--gpu-memory-gb": memory_gb, "--gpu-tflops": tflops, "--nvlink-gbps": nvlink_gbps}
    for flag, value in given.items():
        if value is not None and value <= 0:
            raise KitError(f"{flag} must be > 0, got {value}")
    key = (name or "h100").lower()
    base = CATALOGUE.get(key)
    if profile_path:
        profile = gpu_profile.load(profile_path)
        measured = DEVICE_KINDS.get(profile["device_kind"])
        if name and measured and key != measured:
            raise KitError(
                f"the GPU profile {profile_path} was measured on {profile['device_kind']} ({measured}), "
                f"not --gpu {name}; drop --gpu or pass a profile measured on a {name}"
            )
        key = measured or (key if name else gpu_profile.slug(profile["device_kind"]))
        base = from_profile(profile, profile_path, key, CATALOGUE.get(key))
    elif base is None:
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise KitError(not_known("--gpu", name, CATALOGUE) + f"; or describe it with {', '.join(missing)}")
        return Gpu(key, int(memory_gb * 1e9), tflops * 1e12, nvlink_gbps * 1e9, "described by the flags")
    if all(v is None for v in given.values()) and base.memory_bytes and base.nvlink_bytes_s:
        return base
    gpu = dataclasses.replace(
        base,
        memory_bytes=int(memory_gb * 1e9) if memory_gb else base.memory_bytes,
        peak_flops=tflops * 1e12 if tflops else base.peak_flops,
        nvlink_bytes_s=nvlink_gbps * 1e9 if nvlink_gbps else base.nvlink_bytes_s,
        source=base.source + "; overridden by the flags",
    )
    missing = {
        flag: what
        for flag, what, value in (
            ("--gpu-memory-gb", "memory size", gpu.memory_bytes),
            ("--nvlink-gbps", "NVLink bandwidth", gpu.nvlink_bytes_s),
        )
        if not value
    }
    if missing:
        raise KitError(
            f"the GPU profile {profile_path} is of {gpu.name}, a GPU the catalogue does not know, and "
            f"gives no {' or '.join(missing.values())}; add {', '.join(missing)}"
        )
    return gpu
