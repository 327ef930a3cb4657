"""One candidate of a plan: the train step compiled for N x G emulated CPU devices, nothing allocated.

The JAX engine builds the abstract sharded state and lowers and compiles the step exactly as a run
would (only its check that the state fits this host's RAM is off: the plan checks against the GPU).
Read from it: state bytes per device (the shardings), XLA's memory analysis, the step's model FLOPs
(its jaxpr) and every collective of the compiled HLO with its replica groups (record/traffic.py).
Runs in the worker process (worker.py), whose device count was set before jax was imported.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.planner import gpu_target, kernel_cost
from alpa_job.record import hlo, traffic


class PlanEngine(JaxEngine):
    """The JAX engine for devices this host does not have: their memory is checked by the plan. Its mesh is
    of `target_devices` where set (GPUs described to XLA, gpu_target.py), else of the emulated CPU devices."""

    check_memory = False
    target_devices: Optional[List[Any]] = None

    def make_mesh(self, mesh_shape, axis_names):
        if self.target_devices is None:
            return super().make_mesh(mesh_shape, axis_names)
        return gpu_target.mesh(self.target_devices, mesh_shape, axis_names)


def compile_candidate(
    config,
    model,
    example: Dict[str, Any],
    strategy: str,
    mesh_shape: Tuple[int, int],
    gpus_per_node: int,
    for_gpu: bool = False,
) -> Dict[str, Any]:
    """Plain data (JSON-able) about one compiled candidate; `for_gpu`: compiled for PlanEngine.target_devices,
    with its kernels (kernel_cost.features) under "kernels"."""
    start = time.perf_counter()
    engine = PlanEngine(config, model, example, strategy, tuple(mesh_shape))
    stats = engine.compile_step(with_initializer=not for_gpu)
    text = stats.hlo_texts[0]
    num_devices = mesh_shape[0] * mesh_shape[1]
    by_kind: Dict[str, Dict[str, Any]] = {
        k: {"count": 0, "bytes": 0, "nvlink_bytes": 0.0, "network_bytes": 0.0} for k in hlo.COLLECTIVE_KINDS
    }
    kernels = None
    if for_gpu:  # each collective once per run: (kind, runs, bytes, NVLink bytes, network bytes, groups read)
        kernels = kernel_cost.features(text, num_devices, gpus_per_node)
        sent = [(c["kind"], c["runs"], c["bytes"], c["nvlink_bytes"], c["network_bytes"], c["groups_read"]) for c in kernels["collectives"]]
    else:  # compiled for CPU, costed for GPUs
        rows = traffic.step_traffic(text, num_devices, gpus_per_node, as_on_gpu=True)
        sent = [(r.kind, 1, r.output_bytes, r.nvlink_bytes, r.network_bytes, r.groups_read) for r in rows]
    for kind, runs, nbytes, nvlink, network, _ in sent:
        slot = by_kind[kind]
        slot["count"] += runs
        slot["bytes"] += nbytes * runs
        slot["nvlink_bytes"] += nvlink * runs
        slot["network_bytes"] += network * runs
    groups_read = all(s[5] for s in sent)
    plan = engine.plan()
    return {
        "strategy": strategy,
        "mesh_shape": list(mesh_shape),
        "state_bytes_per_device": engine.state_bytes_per_device,
        "memory": stats.memory,
        "flops_per_step": stats.flops_per_step,
        "collectives": by_kind,
        "groups_read": groups_read,
        "kernels": kernels,
        "compile_s": round(time.perf_counter() - start, 2),
        "params": [leaf.__dict__ for leaf in plan.leaf_records() if leaf.path.startswith("params/")],
    }


def candidate_leaves(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    return list(result.get("params") or [])
