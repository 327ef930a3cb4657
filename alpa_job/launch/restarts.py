"""Restarting a multi-process JAX job after a node or process loss: the pure decisions.

Everything here is a function of plain data (node rows, sizes, step numbers), so it is tested
without a cluster (tests/test_node_loss.py's unit part); cluster/processes.py does the Ray calls.

- `Lost`: what the driver knows of a process that died (host, IP, Ray node id, index, step).
- `view_settled(nodes, lost)`: Ray's node table no longer shows a lost node as alive (it was marked
  dead or removed), or the node is alive under a NEW id (its raylet restarted). Until then a new
  process could be placed on a node that is already gone: the `--resume` crash of issue 12.
- `eligible_nodes(nodes, lost)`: the alive nodes a new attempt may use; a lost node's id never, its IP
  not while Ray still lists the lost id alive there (after that, a node at that IP is a replacement).
- `check_batch_divides(...)`: the global batch stays the same on the shrunk mesh and must divide its
  data axis; else one line naming the sizes.
- `trajectory_counts(...)`: steps / samples_seen of the final trajectory, each step counted once.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional, Sequence, Set, Tuple

from alpa_job.errors import KitError


@dataclasses.dataclass
class Lost:
    """A JAX process that died (and the node it ran on)."""

    index: int
    host: Optional[str]
    ip: str
    node_id: str
    step: Optional[int] = None  # the last step it reported (None: it never reported one)
    reason: str = ""

    def where(self) -> str:
        return "process %d on host %s (node IP %s, Ray node id %s)" % (
            self.index, self.host or "?", self.ip, self.node_id or "?")


def view_settled(nodes: Iterable, lost: Sequence[Lost]) -> bool:
    """True when no lost node id is still listed alive (`nodes`: ray_api.RayNode rows, any state)."""
    lost_ids = {x.node_id for x in lost if x.node_id}
    return not any(n.alive and n.node_id in lost_ids for n in nodes)


def node_alive(nodes: Iterable, node_id: str) -> bool:
    return any(n.alive and n.node_id == node_id for n in nodes)


def eligible_nodes(nodes: Iterable, lost: Sequence[Lost], min_cpus: float = 1.0,
                   healthy_ids: Optional[Set[str]] = None) -> List:
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


def data_axis(strategy: str, devices: int, model_parallel: int = 0) -> int:
    from alpa_job.engines.sharding_rules import mesh_shape_for  # the engine's own mesh rule (imports jax)

    if strategy == "auto":
        return devices  # auto's candidates all keep the whole data axis at least as a divisor
    return mesh_shape_for(strategy, devices, model_parallel)[0]


def check_batch_divides(batch_size: int, processes: int, devices_per_process: int, strategy: str,
                        model_parallel: int = 0, before: Optional[int] = None) -> int:
    """The data axis of `processes` x `devices_per_process` devices; a KitError when the global batch
    does not divide it (the batch never changes on a restart: the data stream must stay the same)."""
    data = data_axis(strategy, processes * devices_per_process, model_parallel)
    if batch_size % data:
        was = " (was %d process(es))" % before if before else ""
        raise KitError("cannot restart on %d process(es)%s: --batch-size %d is not divisible by the new data axis %d "
                       "(%d process(es) x %d devices); use a batch size that every surviving process count divides, "
                       "e.g. %d" % (processes, was, batch_size, data, processes, devices_per_process,
                                    _lcm_multiple(batch_size, data)))
    return data


def _lcm_multiple(batch: int, data: int) -> int:
    from math import gcd

    return batch * data // gcd(batch, data)


def samples_in_steps(epoch_steps: int, full_batches: int, remainder: int, policy: str, batch_size: int,
                     start: int, end: int) -> Tuple[int, int]:
    """(samples seen, samples dropped) over global steps [start, end): every full batch holds
    `batch_size` real samples; with policy "pad" an epoch's last step holds `remainder`; with "drop" an
    epoch that ran to its end drops `remainder` samples (as train.run_loop counts them)."""
    seen = dropped = 0
    for step in range(start, end):
        index = step % epoch_steps
        seen += batch_size if index < full_batches else remainder
        if index == epoch_steps - 1 and policy == "drop":
            dropped += remainder
    return seen, dropped


def trajectory_counts(final_steps: int, final_samples: int, final_dropped: int, run_start: int,
                      resumed_from: int, epoch, batch_size: int) -> Tuple[int, int, int]:
    """(steps, samples_seen, samples_dropped) of the run's final trajectory: the steps [run_start,
    resumed_from) that earlier attempts ran and the last checkpoint kept, plus the final attempt's own.
    Steps an attempt ran past its last checkpoint were lost and are not counted."""
    seen, dropped = samples_in_steps(epoch.steps, epoch.full_batches, epoch.remainder, epoch.policy, batch_size,
                                     run_start, resumed_from)
    return final_steps + (resumed_from - run_start), final_samples + seen, final_dropped + dropped
