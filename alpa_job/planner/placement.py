"""Where a plan's mesh axes run: inside a node, across nodes, or both (the kit lays devices out
node-major: node k holds devices k*G .. k*G+G-1; record/traffic.py reads what each collective sends)."""
from __future__ import annotations

from typing import Dict, Sequence


def node_axes(mesh_shape: Sequence[int], gpus_per_node: int) -> Dict[str, str]:
    """Per mesh axis ("data", "model"), where its steps go: 'inside a node', 'across nodes' or 'both'."""
    data, model = mesh_shape
    out = {"model": "inside a node" if model <= gpus_per_node else "across nodes"}
    if data <= 1:
        out["data"] = "none (size 1)"
    elif model >= gpus_per_node:
        out["data"] = "across nodes"
    elif data * model <= gpus_per_node:
        out["data"] = "inside a node"
    else:
        out["data"] = "both (inside a node, then across nodes)"
    if model <= 1:
        out["model"] = "none (size 1)"
    return out
