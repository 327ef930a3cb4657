"""`doctor --network`, second half: one JAX process a node (its GPUs, or its CPU), joined as a training job
joins them, times an all-reduce over every device: the job's own stack end to end (NCCL on GPUs, JAX's
CPU collectives on CPU hosts), reported as nccl-tests report it, bus bandwidth = 2 (n - 1) / n x bytes / time.

On GPUs NCCL writes its INFO lines (INIT, NET) to a file a process, which the doctor reads back for the
transports it chose on each channel and the interface it bound.

The probe side imports jax only inside `all_reduce` (the doctor itself runs on the Alpa image's stack too).
"""
from __future__ import annotations

import glob
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional

from alpa_job.cluster.doctor.checks import check

ALL_REDUCE_BYTES = 32 << 20  # each device's buffer: large enough to be bandwidth-bound on sockets and NVLink
REPEATS = 5
JOIN_TIMEOUT_S = 30
NCCL_LINES_KEPT = 400


def all_reduce(coordinator: str, processes: int, index: int, nbytes: int = ALL_REDUCE_BYTES,
               repeats: int = REPEATS, join_timeout_s: int = JOIN_TIMEOUT_S) -> Dict[str, Any]:
    """(probe side) Join the doctor's JAX processes, time a psum of `nbytes` a device: its figures, and on
    GPUs NCCL's own log lines."""
    log_dir = tempfile.mkdtemp(prefix="alpa-doctor-nccl-")
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET",
                      NCCL_DEBUG_FILE=os.path.join(log_dir, "nccl.%h.%p.log"))
    from alpa_job.launch.jax_process import init_distributed

    init_distributed(coordinator, processes, index, join_timeout_s)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from alpa_job.engines.pipeline import _shard_map

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("all",))
    per_device = nbytes // 4
    sharding = NamedSharding(mesh, PartitionSpec("all"))
    x = jax.make_array_from_callback((len(devices) * per_device,), sharding,
                                     lambda where: np.ones((per_device,), np.float32))
    summed = jax.jit(_shard_map()(lambda a: jax.lax.psum(a, "all"), mesh=mesh, in_specs=PartitionSpec("all"),
                                  out_specs=PartitionSpec("all")))
    summed(x).block_until_ready()  # compile, and NCCL's communicators
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        summed(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return {"backend": jax.default_backend(), "devices": len(devices), "local_devices": jax.local_device_count(),
            "bytes": per_device * 4, "seconds": statistics.median(times), "nccl_lines": _nccl_lines(log_dir)}


def _nccl_lines(log_dir: str) -> List[str]:
    lines: List[str] = []
    for path in sorted(glob.glob(os.path.join(log_dir, "nccl.*.log"))):
        with open(path, errors="replace") as f:
            lines += [line.rstrip("\n") for line in f if "NCCL INFO" in line][:NCCL_LINES_KEPT]
    return lines


def bus_gbps(result: Dict[str, Any]) -> Optional[float]:
    """nccl-tests' all-reduce bus bandwidth, Gb/s: what each device's links carried."""
    n, seconds = result.get("devices") or 0, result.get("seconds") or 0
    if n < 2 or seconds <= 0:
        return None
    return round(2 * (n - 1) / n * result["bytes"] / seconds * 8 / 1e9, 4)


def verdicts(results: Dict[str, Dict[str, Any]], failed: Dict[str, str], declared_gbps: float = 0.0,
             fabric: str = "ethernet") -> List[Dict[str, Any]]:
    """Checks: nodes whose JAX process did not join or finish, the group's bus bandwidth (against the declared
    bandwidth, where one is declared), and on GPUs what NCCL's own log says."""
    out = [check("collective", ip, False, "the all-reduce probe did not finish on %s: %s" % (ip, why),
                 "open the xla_grpc range (the coordinator) and the ephemeral range (NCCL, gloo) between members: "
                 "python -m alpa_job.cluster.firewall") for ip, why in sorted(failed.items())]
    if not results or failed:
        return out
    first = results[sorted(results)[0]]
    gbps = bus_gbps(first)
    detail = "all-reduce of %d MiB a device over %d %s device(s) on %d node(s): %.3g ms, bus bandwidth %s Gb/s" % (
        first["bytes"] >> 20, first["devices"], first["backend"], len(results), first["seconds"] * 1e3,
        "%.3g" % gbps if gbps is not None else "-")
    slow = bool(gbps is not None and declared_gbps and gbps < 0.5 * declared_gbps)
    out.append(check("collective", None, not slow, detail + (" (declared %.3g Gb/s)" % declared_gbps if declared_gbps
                                                            else ""),
                     "see the link checks and NCCL's transports above: a collective well below the declared "
                     "bandwidth usually runs on sockets or a slow link"))
    out += nccl_checks(results, fabric)
    return out


def nccl_checks(results: Dict[str, Dict[str, Any]], fabric: str) -> List[Dict[str, Any]]:
    """What NCCL's own lines say, a node at a time (none on CPU hosts: no NCCL there)."""
    from alpa_job.cluster.doctor import nccl_log

    out = []
    for ip in sorted(results):
        lines = results[ip].get("nccl_lines") or []
        if not lines:
            continue
        summary = nccl_log.parse_lines(lines)
        problems = nccl_log.verdicts(summary, fabric, host=ip)
        out.append(check("nccl", ip, True, nccl_log.transports_line(summary)))
        for line in problems:  # "what is wrong on HOST: the fix"
            what, _, fix = line.rpartition(": ")
            out.append(check("nccl", ip, False, what or line, fix))
    return out
