"""The candidates of a plan: every strategy x mesh shape `--strategy auto` would try on N x G devices (one
process a node, so tensor's model axis inside a node), less those whose data axis does not divide the
global batch (each kept as a row saying so)."""
from __future__ import annotations

from typing import Dict, List, Tuple

from alpa_job import strategies as strategy_records
from alpa_job.errors import KitError

Candidate = Tuple[str, Tuple[int, int]]


def plan_candidates(nodes: int, gpus_per_node: int, batch_size: int,
                    strategies: Tuple[str, ...] = tuple(strategy_records.STRATEGIES)) -> Tuple[List[Candidate], List[Dict]]:
    """(candidates to compile, rows of those skipped with a note)."""
    if nodes < 1 or gpus_per_node < 1:
        raise KitError(f"--nodes and --gpus-per-node must be >= 1, got {nodes} and {gpus_per_node}")
    devices = nodes * gpus_per_node
    every = [(s, m) for s, m in strategy_records.auto_candidates(devices, gpus_per_node) if s in strategies]
    kept = [(s, m) for s, m in every if batch_size % m[0] == 0]
    skipped = [{"strategy": s, "mesh_shape": list(m),
                "note": f"batch {batch_size} is not divisible by the data axis {m[0]}"} for s, m in every
               if batch_size % m[0]]
    if not kept:
        sizes = sorted({m[0] for _, m in every})
        raise KitError(f"--batch-size {batch_size} is not divisible by the data axis of any candidate on "
                       f"{devices} devices (data axes: {', '.join(map(str, sizes))}); use a multiple of "
                       f"{min(sizes)}, e.g. {devices} (one sequence per GPU)")
    return kept, skipped
