"""The typed plan record: what `python -m alpa_job plan` found; plan.json is its serialization.

One row per candidate (strategy x mesh shape) with its memory, traffic and estimated step time, the
cluster it was planned for, the fitted constants and the assumptions behind the estimate. The JSON
Schema shipped beside it (plan.schema.json) is strict. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

from alpa_job.record.run_record import Leaf

PLAN_SCHEMA_VERSION = 1
PLAN_SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan.schema.json")


@dataclasses.dataclass
class PlanGpu:
    name: str
    memory_bytes: int
    peak_flops: float
    nvlink_bytes_s: float
    source: str
    profile: Optional[str] = None  # the GPU profile (plan calibrate) the numbers came from, None: the catalogue


@dataclasses.dataclass
class PlanCluster:
    nodes: int
    gpus_per_node: int
    devices: int
    gpu: PlanGpu
    network_bytes_s: float  # one GPU's share of the network, one direction
    usable_bytes_per_device: int  # what a candidate's peak must stay under


@dataclasses.dataclass
class PlanCollective:
    """One collective kind of a candidate's step: HLO instances, their result bytes, and what one device
    sends over NVLink (inside a node) and over the network (across nodes)."""

    count: int = 0
    bytes: int = 0
    nvlink_bytes: float = 0.0
    network_bytes: float = 0.0


@dataclasses.dataclass
class PlanCandidate:
    strategy: str
    mesh_shape: List[int]
    rank: Optional[int] = None  # 1 = fastest of those that fit
    fits: Optional[bool] = None
    state_bytes_per_device: Optional[int] = None  # exact, from the shardings
    cpu_peak_bytes: Optional[int] = None  # XLA's estimate compiled for CPU devices
    gpu_peak_bytes: Optional[int] = None  # corrected for the GPU (calibration's temp_ratio)
    flops_per_step: Optional[float] = None  # all devices together
    collectives: Dict[str, PlanCollective] = dataclasses.field(default_factory=dict)
    nvlink_bytes: Optional[float] = None  # per device per step
    network_bytes: Optional[float] = None  # per device per step
    axes: Dict[str, str] = dataclasses.field(default_factory=dict)  # mesh axis -> inside a node / across nodes
    compute_s: Optional[float] = None
    communication_s: Optional[float] = None
    step_s: Optional[float] = None
    dominant: Optional[str] = None  # the largest term of step_s: compute, NVLink or network
    compile_s: Optional[float] = None
    note: str = ""
    params: List[Leaf] = dataclasses.field(default_factory=list)  # the best candidate's, for its mesh picture


@dataclasses.dataclass
class PlanRecord:
    model: str
    preset: Optional[str]
    settings: Dict[str, Any]
    cluster: PlanCluster
    constants: Dict[str, Any]
    assumptions: List[str]
    candidates: List[PlanCandidate]
    best: Optional[int] = None  # index into candidates
    created: Optional[str] = None
    versions: Dict[str, Optional[str]] = dataclasses.field(default_factory=dict)
    schema_version: int = PLAN_SCHEMA_VERSION

    def to_dict(self) -> Dict[str, Any]:
        data = dataclasses.asdict(self)
        return {"schema_version": data.pop("schema_version"), **data}


def load_plan_schema() -> Dict[str, Any]:
    with open(PLAN_SCHEMA_PATH) as f:
        return json.load(f)
