"""Where a job's processes go: the nodes an attempt may use, and whether the global batch still divides the
data axis of a shrunk attempt. Pure functions of plain data (node rows, sizes), tested without a cluster:
- `eligible_nodes(nodes, lost)`: the alive nodes a new attempt may use; a lost node's id never, its IP
  not while Ray still lists the lost id alive there (after that, a node at that IP is a replacement);
- `check_batch_divides(...)`: the global batch stays the same on the shrunk mesh (the data stream must
  not change) and must divide its data axis; else one line naming the sizes.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Set

from alpa_job import strategies
from alpa_job.launch.failures import Lost


def eligible_nodes(nodes: Iterable, lost: Sequence[Lost], min_cpus: float = 1.0, healthy_ids: Optional[Set[str]] = None) -> List:
    """Alive nodes a new attempt may run on, in the given order.

    Excluded: every lost node id (unless it was found healthy: its process died, the node did not), and
    every node at a lost IP while Ray still lists the lost id there as alive (the stale view). Once Ray has
    marked it dead, a node alive at that IP has a new id: a replacement (its raylet restarted), usable.
    """
    nodes = list(nodes)
    healthy_ids = healthy_ids or set()
    lost_ids = {x.node_id for x in lost if x.node_id} - healthy_ids
    stale_ips = {n.ip for n in nodes if n.alive and n.node_id in lost_ids}
    out = []
    for n in nodes:
        if not n.alive or not n.ip or n.cpus() < min_cpus or n.node_id in lost_ids or n.ip in stale_ips:
            continue
        out.append(n)
    return out


def check_batch_divides(
    batch_size: int, processes: int, devices_per_process: int, strategy: str, model_parallel: int = 0, before: Optional[int] = None
) -> int:
    """The data axis of `processes` x `devices_per_process` devices; a KitError when the global batch
    does not divide it (the batch never changes on a restart: the data stream must stay the same)."""
    data = strategies.data_axis_size(strategy, processes * devices_per_process, model_parallel, devices_per_process)
    was = " (was %d process(es))" % before if before else ""
    strategies.check_batch_split(
        batch_size,
        data,
        "the batch stays the same on a restart (the data stream must not change): use a batch "
        "size that every surviving process count divides, e.g. %d" % _lcm_multiple(batch_size, data),
        when="cannot restart on %d process(es)%s of %d devices: " % (processes, was, devices_per_process),
    )
    return data


def _lcm_multiple(batch: int, data: int) -> int:
    from math import gcd

    return batch * data // gcd(batch, data)
