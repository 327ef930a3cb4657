"""A GPU profile: what `python -m alpa_job plan calibrate` measured on one machine, read by `plan --gpu-profile`.

A JSON object (version 1); the planner reads the fields marked *, the rest is the record of the run:

    schema            "alpa_job.gpu_profile"
    version           1
    device_kind *     jax's device_kind ("NVIDIA H200"): picks the catalogue GPU for memory and NVLink
    platform *        "gpu" (plan refuses any other: a CPU's numbers plan no GPU)
    devices           local devices measured on (> 1: the collectives ran)
    memory_bytes *    one device's total memory (nvidia-smi), or null
    peak_flops *      {precision: FLOP/s}, the best matmul rate of each precision measured (bf16 required;
                      tf32 = float32 at jax's default precision on Ampere and later, fp32 = HIGHEST, fp8)
    matmul            [{precision, m, n, k, products_a_call, seconds, flops_s}]: every shape measured
    hbm *             {op, read_bytes, written_bytes, seconds, bytes_s}: one large elementwise pass
    launch *          {kernel_seconds: one more kernel in a compiled program, chain, chain_seconds,
                      dispatch_seconds: one jitted call from Python}
    collectives       [{op, devices, bytes, seconds, algbw_bytes_s, busbw_bytes_s}]
    collective_busbw * {op: {bytes, busbw_bytes_s, devices}}: each collective's largest size ({} on one device)
    loop *            [{devices, steps, step_seconds, p90_seconds}]: the kit's training loop over a near-empty
                      model on that many devices, the host's floor under a step (optional: older profiles)
    skipped           what the time budget or the device left out, and why
    measured_seconds, versions {jax, jaxlib, python}, created (UTC, ISO 8601), command, note (CPU only)

How plan uses it: the bf16 peak replaces the catalogue's peak FLOP/s (the compute term divides by it);
the all-reduce bus bandwidth, where several devices were measured, replaces the NVLink bandwidth; HBM
bandwidth and launch overhead are carried in the plan's GPU (gpus.Gpu) for a cost model that uses them.
"""

from __future__ import annotations

import json
import numbers
import os
import re
from typing import Any, Dict

from alpa_job.errors import KitError

SCHEMA = "alpa_job.gpu_profile"
VERSION = 1
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
FIX = "write one with python -m alpa_job plan calibrate --out FILE on a machine with that GPU"


def slug(device_kind: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': a file name part."""
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"


def _number(value: Any, positive: bool = True) -> bool:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value
    return ok and (value > 0 if positive else value >= 0)


def validate(data: Any, where: str) -> Dict[str, Any]:
    """`data` if it is a profile this kit reads; else a one-line KitError naming the field and the fix."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise KitError(f'{where} is not a GPU profile (no "schema": "{SCHEMA}"); {FIX}')
    version = data.get("version")
    if not isinstance(version, int) or version > VERSION or version < 1:
        raise KitError(
            f"{where} is a GPU profile of version {version!r}, this kit reads {VERSION}; measure again "
            "with this kit's python -m alpa_job plan calibrate"
        )

    def bad(field: str, what: str) -> KitError:
        return KitError(f"{where}: {field} {what}; measure again with python -m alpa_job plan calibrate")

    for field in ("device_kind", "platform", "created", "command"):
        if not isinstance(data.get(field), str) or not data[field]:
            raise bad(field, "is missing or not a string")
    if not isinstance(data.get("devices"), int) or data["devices"] < 1:
        raise bad("devices", "is missing or not a positive integer")
    if data.get("memory_bytes") is not None and not (isinstance(data["memory_bytes"], int) and data["memory_bytes"] > 0):
        raise bad("memory_bytes", "is not a positive integer or null")
    peaks = data.get("peak_flops")
    if not isinstance(peaks, dict) or not _number(peaks.get("bf16")):
        raise bad("peak_flops.bf16", "is missing or not a positive number (FLOP/s)")
    for name, value in peaks.items():
        if not _number(value):
            raise bad(f"peak_flops.{name}", "is not a positive number (FLOP/s)")
    if not isinstance(data.get("hbm"), dict) or not _number(data["hbm"].get("bytes_s")):
        raise bad("hbm.bytes_s", "is missing or not a positive number (bytes/s)")
    launch = data.get("launch")
    if (
        not isinstance(launch, dict)
        or not _number(launch.get("kernel_seconds"), positive=False)
        or not _number(launch.get("dispatch_seconds"))
    ):
        raise bad("launch", "needs kernel_seconds >= 0 and dispatch_seconds > 0")
    bus = data.get("collective_busbw")
    if not isinstance(bus, dict):
        raise bad("collective_busbw", "is missing or not an object")
    for op, row in bus.items():
        if not isinstance(row, dict) or not _number(row.get("busbw_bytes_s")) or not isinstance(row.get("devices"), int):
            raise bad(f"collective_busbw.{op}", "needs busbw_bytes_s > 0 and devices")
    for row in data.get("loop", []) if isinstance(data.get("loop", []), list) else [None]:
        if not isinstance(row, dict) or not isinstance(row.get("devices"), int) or not _number(row.get("step_seconds")):
            raise bad("loop", "needs a list of {devices, step_seconds > 0}")
    for field in ("matmul", "collectives", "skipped"):
        if not isinstance(data.get(field), list):
            raise bad(field, "is missing or not a list")
    if not isinstance(data.get("versions"), dict) or not isinstance(data["versions"].get("jax"), str):
        raise bad("versions.jax", "is missing")
    return data


def load(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise KitError(f"cannot read the GPU profile {path} ({err.strerror}); {FIX}") from None
    except ValueError as err:
        raise KitError(f"the GPU profile {path} is not JSON ({err}); {FIX}") from None
    return validate(data, f"the GPU profile {path}")


def write(profile: Dict[str, Any], path: str) -> None:
    try:
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            json.dump(profile, f, indent=1)
            f.write("\n")
    except OSError as err:
        raise KitError(f"cannot write the GPU profile to {path} ({err.strerror}); pass --out a writable file") from None


def shipped(name: str) -> Dict[str, Any]:
    """The profile the kit ships for a catalogue GPU (profiles/NAME.json)."""
    return load(os.path.join(SHIPPED_DIR, f"{name}.json"))


def has_shipped(name: str) -> bool:
    return os.path.exists(os.path.join(SHIPPED_DIR, f"{name}.json"))
