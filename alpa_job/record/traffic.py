"""What each collective of a compiled step sends over which link: within a node (NVLink) or across nodes.

The kit lays the device list out node-major (node k holds devices k*G .. k*G+G-1) and builds the mesh
(data, model) by reshaping that list, so a device's mesh position is its id and its node is id // G:
a `model` axis of size <= G stays inside a node, `data` crosses nodes (a running job passes each device's
node itself: `node_of`). Each collective's replica groups
are read from the compiled HLO (the partition ids XLA itself uses), so a group's nodes are exact; a group
whose text this module cannot read is assumed to span every device (the most it could send), and marked so.

Traffic per device for a group of n devices, g of them per node on m = n / g nodes, output S bytes
(ring / hierarchical algorithms, what NCCL does for large messages):
  all-reduce        NVLink 2(g-1)/g S       network 2(m-1)/m S/g
  all-gather        NVLink (g-1)/g S        network (m-1)/m S/g
  reduce-scatter    as all-gather of the whole input (n S)
  all-to-all        NVLink (g-1)/n S        network (n-g)/n S
  collective-permute  S over NVLink, or over the network when a pair crosses nodes
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

from alpa_job.record import hlo

Groups = List[List[int]]


def _iota(dims: Sequence[int], perm: Optional[Sequence[int]]) -> List[int]:
    """XLA's iota tile assignment: 0..prod(dims)-1 shaped `dims`, transposed by `perm`, flattened."""
    total = 1
    for d in dims:
        total *= d
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    order = list(perm) if perm else list(range(len(dims)))
    shape = [dims[p] for p in order]
    out = []
    for flat in range(total):
        index, rest = [0] * len(shape), flat
        for i in range(len(shape) - 1, -1, -1):
            index[i], rest = rest % shape[i], rest // shape[i]
        out.append(sum(index[i] * strides[order[i]] for i in range(len(shape))))
    return out


def _ints(text: str) -> List[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def replica_groups(attributes: str, num_devices: int) -> Optional[Groups]:
    """The device groups of one collective instruction's attribute text; None when unreadable."""
    explicit = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attributes)
    if explicit:
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", explicit.group(1))]
        return groups or [list(range(num_devices))]
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if iota:
        shape, ids = _ints(iota.group(1)), _iota(_ints(iota.group(2)), _ints(iota.group(3) or ""))
        size = shape[-1]
        return [ids[i : i + size] for i in range(0, len(ids), size)]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](.*?)\{([^}]*)\}", attributes)
    if mesh:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        device_ids = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", mesh.group(2))
        ids = _iota(_ints(device_ids.group(1)), _ints(device_ids.group(2) or "")) if device_ids else list(range(math.prod(sizes)))
        over = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(3)) if a in names]
        return _groups_over(ids, sizes, over)
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attributes)
    if pairs:
        return [_ints(p) for p in re.findall(r"\{(\d+,\d+)\}", pairs.group(1))]
    return None


def _groups_over(ids: List[int], sizes: List[int], over: List[int]) -> Groups:
    """Devices laid out on a mesh of `sizes` (row-major `ids`); one group per position of the other
    axes, varying the axes `over`."""
    keep = [i for i in range(len(sizes)) if i not in over]
    groups: Dict[Tuple[int, ...], List[int]] = {}
    for flat, device in enumerate(ids):
        index, rest = [0] * len(sizes), flat
        for i in range(len(sizes) - 1, -1, -1):
            index[i], rest = rest % sizes[i], rest // sizes[i]
        groups.setdefault(tuple(index[i] for i in keep), []).append(device)
    return list(groups.values())


@dataclasses.dataclass
class Traffic:
    """One collective instance: its HLO result bytes and what each device sends per link."""

    kind: str
    output_bytes: int
    group_size: int
    per_node: int  # group members on one node
    nvlink_bytes: float  # per device
    network_bytes: float  # per device
    groups_read: bool  # False: assumed from the mesh, not read from the HLO


def traffic(
    kind: str, output_bytes: int, groups: Optional[Groups], num_devices: int, gpus_per_node: int, node_of: Optional[Sequence[int]] = None
) -> Traffic:
    """`node_of[d]`: the node of the device at mesh position d (default: d // gpus_per_node)."""

    def node(d: int) -> int:
        return node_of[d] if node_of is not None else d // gpus_per_node

    read = groups is not None
    if groups is None:
        groups = [list(range(num_devices))]  # unreadable: the most traffic it could cause
    if kind == "collective-permute":
        crosses = any(node(a) != node(b) for a, b in (p for p in groups if len(p) == 2))
        s = float(output_bytes)
        return Traffic(kind, output_bytes, 2, 1 if crosses else 2, 0.0 if crosses else s, s if crosses else 0.0, read)
    group = max(groups, key=len) if groups else list(range(num_devices))
    n = len(group)
    nodes: Dict[int, int] = {}
    for d in group:
        nodes[node(d)] = nodes.get(node(d), 0) + 1
    g = max(nodes.values())
    m = max(n // g, 1)
    s = float(output_bytes)
    if n <= 1:
        return Traffic(kind, output_bytes, n, g, 0.0, 0.0, read)
    if kind == "reduce-scatter":
        s, kind_like = s * n, "all-gather"
    else:
        kind_like = kind
    if kind_like == "all-reduce":
        intra, inter = 2 * (g - 1) / g * s, 2 * (m - 1) / m * s / g
    elif kind_like == "all-gather":
        intra, inter = (g - 1) / g * s, (m - 1) / m * s / g
    else:  # all-to-all
        intra, inter = (g - 1) / n * s, (n - g) / n * s
    return Traffic(kind, output_bytes, n, g, intra, inter, read)


def step_traffic(
    hlo_text: str, num_devices: int, gpus_per_node: int, node_of: Optional[Sequence[int]] = None, as_on_gpu: bool = False
) -> List[Traffic]:
    """Every collective of a compiled step (hlo.collective_instances' bytes) with its traffic; `as_on_gpu`: a
    step compiled for CPU devices counted as XLA:GPU would run it (record/gpu_view.py)."""
    return [row for _, row in named_step_traffic(hlo_text, num_devices, gpus_per_node, node_of, as_on_gpu)]


def named_step_traffic(
    hlo_text: str, num_devices: int, gpus_per_node: int, node_of: Optional[Sequence[int]] = None, as_on_gpu: bool = False
) -> List[Tuple[str, Traffic]]:
    """step_traffic's rows, each with its instruction's name in the HLO (an asynchronous collective's start)."""
    attributes: Dict[str, str] = {}
    for line in hlo_text.splitlines():
        inst = hlo.parse_instruction(line)
        if inst is not None and ("replica_groups" in inst[3] or "source_target_pairs" in inst[3]):
            attributes[inst[0]] = inst[3]

    groups_of = {name: replica_groups(text, num_devices) for name, text in attributes.items()}

    def group_size(name: str) -> int:
        groups = groups_of.get(name)
        return max((len(g) for g in groups), default=num_devices) if groups else num_devices

    if as_on_gpu:
        from alpa_job.record import gpu_view

        instances = gpu_view.collective_instances(hlo_text, group_size)
    else:
        instances = hlo.collective_instances(hlo_text)
    out = []
    for kind, name, nbytes in instances:
        groups = groups_of.get(name)  # None: unreadable, counted as spanning every device
        out.append((name, traffic(kind, nbytes, groups, num_devices, gpus_per_node, node_of)))
    return out


def summary(rows: Sequence[Traffic]) -> Dict[str, object]:
    """A step's traffic per device: bytes within a node and across nodes, and the collectives that cross."""
    return {
        "within_host_bytes": int(round(sum(r.nvlink_bytes for r in rows))),
        "across_hosts_bytes": int(round(sum(r.network_bytes for r in rows))),
        "collectives": len(rows),
        "collectives_across_hosts": sum(1 for r in rows if r.network_bytes > 0),
        "groups_read": all(r.groups_read for r in rows),
    }
