"""Where a plan's mesh axes run: inside a node, across nodes, or both (the kit lays devices out
node-major: node k holds devices k*G .. k*G+G-1; record/traffic.py reads what each collective sends)."""

from __future__ import annotations

from typing import Dict, Sequence

from alpa_job.strategies import MESH_AXES


def node_axes(mesh_shape: Sequence[int], gpus_per_node: int, axis_names: Sequence[str] = MESH_AXES) -> Dict[str, str]:
    """Per mesh axis (the outer one, e.g. "data", then the inner one, e.g. "model"), where its steps go:
    'inside a node', 'across nodes' or 'both'."""
    outer_size, inner_size = mesh_shape
    outer, inner = axis_names
    if inner_size <= 1:
        inner_where = "none (size 1)"
    else:
        inner_where = "inside a node" if inner_size <= gpus_per_node else "across nodes"
    if outer_size <= 1:
        outer_where = "none (size 1)"
    elif inner_size >= gpus_per_node:
        outer_where = "across nodes"
    elif outer_size * inner_size <= gpus_per_node:
        outer_where = "inside a node"
    else:
        outer_where = "both (inside a node, then across nodes)"
    return {outer: outer_where, inner: inner_where}
