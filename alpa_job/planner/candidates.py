"""The candidates of a plan: every strategy x mesh shape `--strategy auto` would try on N x G devices (one
process a node, so tensor's model axis inside a node), less those whose data axis does not divide the
global batch, or a pipeline's micro-batches (each kept as a row saying so)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from alpa_job import strategies as strategy_records
from alpa_job.errors import KitError

Candidate = Tuple[str, Tuple[int, int]]


def plan_candidates(
    nodes: int,
    gpus_per_node: int,
    batch_size: int,
    strategies: Optional[Tuple[str, ...]] = None,
    micro_batches: int = 0,
) -> Tuple[List[Candidate], List[Dict]]:
    """(candidates to compile, rows of those skipped with a note). `strategies`: the names asked (None: every
    strategy, as auto tries them). A pipeline asked by name on one node of several GPUs is planned with its
    two stages there: auto leaves it out (on one host it only adds its bubble), but a user weighing it
    against data asks what it would cost."""
    if nodes < 1 or gpus_per_node < 1:
        raise KitError(f"--nodes and --gpus-per-node must be >= 1, got {nodes} and {gpus_per_node}")
    devices = nodes * gpus_per_node
    every = [(s, m) for s, m in strategy_records.auto_candidates(devices, gpus_per_node) if strategies is None or s in strategies]
    if nodes == 1 and devices > 1:
        every += [
            (name, strategy_records.get(name).mesh_shape(devices, 0, gpus_per_node))
            for name in strategies or ()
            if strategy_records.get(name).pipelined
        ]
    if not every:
        raise KitError(
            f"--strategy {', '.join(strategies or ())} has no candidate on {nodes} node(s) of {gpus_per_node} GPU(s): "
            "hsdp needs several nodes of several GPUs, pipeline several GPUs; "
            "plan more --nodes or another --strategy"
        )
    notes = {(s, m): _batch_note(s, m, batch_size, micro_batches) for s, m in every}
    kept = [(s, m) for s, m in every if not notes[(s, m)]]
    skipped = [{"strategy": s, "mesh_shape": list(m), "note": notes[(s, m)]} for s, m in every if notes[(s, m)]]
    if not kept:
        sizes = sorted({strategy_records.get(s).batch_ways(m) for s, m in every})
        raise KitError(
            f"--batch-size {batch_size} is not divisible by the data axis of any candidate on "
            f"{devices} devices (data axes: {', '.join(map(str, sizes))}); use a multiple of "
            f"{min(sizes)}, e.g. {devices} (one sequence per GPU)"
        )
    return kept, skipped


def _batch_note(strategy: str, mesh: Tuple[int, int], batch_size: int, micro_batches: int) -> str:
    """Why the global batch cannot be split for this candidate ('' when it can)."""
    record = strategy_records.get(strategy)
    try:
        strategy_records.check_batch_split(batch_size, record.batch_ways(mesh))
        if record.pipelined:
            strategy_records.check_micro_batches(batch_size, mesh, strategy_records.micro_batches(micro_batches, mesh[0]))
    except KitError as err:
        return str(err)
    return ""
