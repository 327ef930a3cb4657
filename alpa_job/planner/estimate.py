"""Step time and memory of a compiled candidate on real GPUs, with constants fitted to measured runs.

    step = compute + NVLink time + network time
    compute = FLOPs per device / (GPU peak x efficiency)
    NVLink time = max(factor[strategy] x NVLink bytes / NVLink bandwidth, that - compute)
    network time = network bytes / network bandwidth

The bytes are what the step's collectives send as XLA:GPU runs them (record/gpu_view.py), per link.
NVLink: whatever part of it the measured runs hid behind compute (or lost to small messages and launch
latency) is in `factor`, fitted per strategy from the one-node multi-GPU runs (factor < 1: partly hidden;
> 1: slower than the catalogue's bandwidth); compute can hide at most its own length. The network: its
bandwidth is a measured one (the doctor's all-reduce, or one given), so no factor fitted on NVLink scales
it, and none of it is assumed hidden. The efficiency is the geometric mean of the one-GPU runs' measured
FLOP rate over the GPU's peak. A strategy with no multi-GPU run takes the median factor of those that have one.

Memory: XLA's CPU compile keeps far more scratch (temp) than the GPU's (no fused attention, other
fusion); the state part (arguments + outputs - aliased) is exact. The GPU peak is estimated as the
state part + temp x `temp_ratio`, the ratio measured on the calibration runs with a known GPU peak.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from typing import Any, Dict, List, Optional

from alpa_job.errors import KitError
from alpa_job.planner import gpus

CALIBRATION_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
VALIDATION_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "validation.json")


@dataclasses.dataclass
class Constants:
    efficiency: float  # of the GPU's peak, for the model FLOPs
    comm_factor: Dict[str, float]  # per strategy
    default_comm_factor: float
    temp_ratio: float  # GPU scratch / CPU scratch
    fitted_from: List[str]

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def load(path: str = CALIBRATION_PATH) -> Dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise KitError(f"cannot read the planner's calibration {path} ({err}); restore it from the repository")


def _cpu(entry: Dict[str, Any]) -> Dict[str, Any]:
    cpu = entry.get("cpu")
    if not cpu:
        raise KitError(f"calibration entry {entry.get('id')!r} has no cpu block; run python -m alpa_job.planner.calibrate")
    return cpu


def nvlink_seconds(collectives: Dict[str, Dict[str, float]], gpu: gpus.Gpu) -> float:
    """Seconds on NVLink if every byte went at its full bandwidth, one collective after the other."""
    return sum(c["nvlink_bytes"] for c in collectives.values()) / gpu.nvlink_bytes_s


def network_seconds(collectives: Dict[str, Dict[str, float]], network_bytes_s: float) -> float:
    return sum(c["network_bytes"] for c in collectives.values()) / network_bytes_s


def state_part(memory: Dict[str, int]) -> int:
    return memory["argument_size_in_bytes"] + memory["output_size_in_bytes"] - memory["alias_size_in_bytes"]


def fit(calibration: Dict[str, Any]) -> Constants:
    entries = calibration["entries"]
    single = [e for e in entries if e["nodes"] * e["gpus_per_node"] == 1]
    if not single:
        raise KitError("the planner's calibration has no one-GPU run, so no compute efficiency; add one")
    rates = [_cpu(e)["flops_per_step"] / (gpus.CATALOGUE[e["gpu"]].peak_flops * e["measured_step_ms"] / 1e3) for e in single]
    efficiency = math.exp(statistics.mean(math.log(r) for r in rates))
    factors: Dict[str, List[float]] = {}
    for e in entries:
        devices = e["nodes"] * e["gpus_per_node"]
        if devices == 1:
            continue
        cpu, gpu = _cpu(e), gpus.CATALOGUE[e["gpu"]]
        compute = cpu["flops_per_step"] / devices / (gpu.peak_flops * efficiency)
        network = network_seconds(cpu["collectives"], e.get("network_gbps", 400) * 1e9 / 8)
        nvlink = nvlink_seconds(cpu["collectives"], gpu)
        if nvlink > 0:
            factors.setdefault(e["strategy"], []).append(max(e["measured_step_ms"] / 1e3 - compute - network, 0.0) / nvlink)
    comm_factor = {s: statistics.median(v) for s, v in factors.items()}
    default = statistics.median(comm_factor.values()) if comm_factor else 1.0
    ratios = []
    for e in entries:
        memory = _cpu(e).get("memory") or {}
        if e.get("measured_peak_gb") and memory.get("temp_size_in_bytes"):
            ratios.append((e["measured_peak_gb"] * 1e9 - state_part(memory)) / memory["temp_size_in_bytes"])
    temp_ratio = statistics.median(ratios) if ratios else 1.0
    return Constants(efficiency, comm_factor, default, temp_ratio, [e["id"] for e in entries])


def gpu_peak_bytes(memory: Optional[Dict[str, int]], constants: Constants) -> Optional[int]:
    if not memory:
        return None
    return int(state_part(memory) + constants.temp_ratio * memory["temp_size_in_bytes"])


def predict(row: Dict[str, Any], devices: int, gpu: gpus.Gpu, network_bytes_s: float, constants: Constants) -> Dict[str, Any]:
    """compute_s, communication_s, step_s and the corrected peak for one compiled candidate."""
    compute = (row["flops_per_step"] or 0.0) / devices / (gpu.peak_flops * constants.efficiency)
    nvlink = nvlink_seconds(row["collectives"], gpu)
    network = network_seconds(row["collectives"], network_bytes_s)
    factor = constants.comm_factor.get(row["strategy"], constants.default_comm_factor)
    nvlink_exposed = max(factor * nvlink, nvlink - compute)
    communication = nvlink_exposed + network
    return {
        "compute_s": compute,
        "link_s": nvlink + network,
        "nvlink_s": nvlink_exposed,
        "network_s": network,
        "comm_factor": factor,
        "communication_s": communication,
        "step_s": compute + communication,
        "gpu_peak_bytes": gpu_peak_bytes(row.get("memory"), constants),
    }


def validation(constants: Constants, path: str = VALIDATION_PATH) -> Dict[str, Any]:
    """The error the plan can be expected to have: each measured run of `path` (runs across hosts the
    constants were not fitted on) predicted now, and the median and worst of the errors."""
    rows = []
    for entry in load(path)["entries"]:
        if entry["nodes"] < 2:  # the runs across hosts: what this model was validated on
            continue
        devices = entry["nodes"] * entry["gpus_per_node"]
        row = {**_cpu(entry), "strategy": entry["strategy"]}
        predicted = predict(row, devices, gpus.CATALOGUE[entry["gpu"]], entry["network_gbps"] * 1e9 / 8, constants)["step_s"] * 1e3
        measured = entry["measured_step_ms"]
        rows.append(
            {
                "id": entry["id"],
                "layout": f"{entry['nodes']}x{entry['gpus_per_node']}",
                "predicted_ms": predicted,
                "measured_ms": measured,
                "error": predicted / measured - 1,
            }
        )
    errors = sorted(abs(r["error"]) for r in rows)
    return {"runs": rows, "median": statistics.median(errors) if errors else None, "worst": errors[-1] if errors else None}
