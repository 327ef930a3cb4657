"""A run's own network, measured where it runs: an all-reduce over every device timed at the start (bus
bandwidth as nccl-tests reports it, 2 (n - 1) / n x bytes / time), and on GPUs the transports NCCL chose,
read from NCCL's own INFO lines, which each process has NCCL write to a file of its own. Before NCCL starts,
each process also takes the cluster's socket settings for NCCL where its node set none.

The doctor (`doctor --network`) runs the same all-reduce in processes of its own.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any, Dict, List, Optional

NCCL_FILE_PREFIX = "/tmp/alpa_job-nccl"  # + .HOST.PID.log: NCCL expands %h and %p itself
NCCL_LINES_KEPT = 400


def prepare_nccl() -> Optional[str]:
    """Before NCCL starts in this process: NCCL's socket settings where the node's environment has none
    (a `ray start` by hand gets what Ansible and KubeRay render), and NCCL's own log asked for; the log's path
    (see ask_nccl_for_its_log)."""
    from alpa_job.cluster.fabric import apply_socket_defaults

    apply_socket_defaults()
    return ask_nccl_for_its_log()


def ask_nccl_for_its_log() -> Optional[str]:
    """Before NCCL starts: have it write its INIT and NET lines to this process's own file; the path, or None
    where the user set NCCL_DEBUG (their choice of output is left alone)."""
    if os.environ.get("NCCL_DEBUG"):
        return None
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=NCCL_FILE_PREFIX + ".%h.%p.log")
    return own_nccl_log()


def own_nccl_log() -> str:
    return "%s.%s.%d.log" % (NCCL_FILE_PREFIX, socket.gethostname(), os.getpid())


def nccl_lines(paths: List[str]) -> List[str]:
    lines: List[str] = []
    for path in paths:
        try:
            with open(path, errors="replace") as f:
                lines += [line.rstrip("\n") for line in f if "NCCL INFO" in line][:NCCL_LINES_KEPT]
        except OSError:
            continue
    return lines


def time_all_reduce(nbytes: int, repeats: int) -> Dict[str, Any]:
    """Time a psum of `nbytes` a device over every device of the joined processes (after one untimed run:
    the compile, and NCCL's communicators)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from alpa_job.jax_compat import shard_map

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("all",))
    per_device = max(1, nbytes // 4)
    x = jax.make_array_from_callback(
        (len(devices) * per_device,), NamedSharding(mesh, PartitionSpec("all")), lambda where: np.ones((per_device,), np.float32)
    )
    summed = jax.jit(
        shard_map()(lambda a: jax.lax.psum(a, "all"), mesh=mesh, in_specs=PartitionSpec("all"), out_specs=PartitionSpec("all"))
    )
    summed(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        summed(x).block_until_ready()
        times.append(time.perf_counter() - start)
    result = {
        "backend": jax.default_backend(),
        "devices": len(devices),
        "processes": jax.process_count(),
        "bytes": per_device * 4,
        "seconds": round(statistics.median(times), 6),
    }
    result["bus_gbps"] = bus_gbps(result)
    return result


def bus_gbps(result: Dict[str, Any]) -> Optional[float]:
    """nccl-tests' all-reduce bus bandwidth, Gb/s: what each device's links carried."""
    n, seconds = result.get("devices") or 0, result.get("seconds") or 0
    if n < 2 or seconds <= 0:
        return None
    return round(2 * (n - 1) / n * result["bytes"] / seconds * 8 / 1e9, 4)
