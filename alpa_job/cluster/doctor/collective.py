"""`doctor --network`, second half: one JAX process a node (its GPUs, or its CPU), joined as a training job
joins them, times an all-reduce over every device: the job's own stack end to end (NCCL on GPUs, JAX's
CPU collectives on CPU hosts), reported as nccl-tests report it, bus bandwidth = 2 (n - 1) / n x bytes / time.

On GPUs NCCL writes its INFO lines (INIT, NET) to a file a process, which the doctor reads back for the
transports it chose on each channel and the interface it bound. The probe's pieces are a training run's
own (alpa_job.cluster.network_probe): the doctor measures what a job would see.

The probe side imports jax only inside `all_reduce` (the doctor itself runs on the Alpa image's stack too).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from alpa_job.cluster.doctor.checks import check
from alpa_job.cluster import network_probe
from alpa_job.units import human_bytes

ALL_REDUCE_BYTES = 32 << 20  # each device's buffer: large enough to be bandwidth-bound on sockets and NVLink
MIN_BYTES = 256 << 10
REPEATS = 5
JOIN_TIMEOUT_S = 30


def all_reduce(
    coordinator: str,
    processes: int,
    index: int,
    nbytes: int = ALL_REDUCE_BYTES,
    repeats: int = REPEATS,
    join_timeout_s: int = JOIN_TIMEOUT_S,
) -> Dict[str, Any]:
    """(probe side, a fresh process) Join the doctor's JAX processes, time a psum of `nbytes` a device: its
    figures, and on GPUs NCCL's own log lines."""
    from alpa_job.cluster.jax_join import init_distributed

    log = network_probe.prepare_nccl()
    init_distributed(coordinator, processes, index, join_timeout_s)
    result = network_probe.time_all_reduce(nbytes, repeats)
    result["nccl_lines"] = network_probe.nccl_lines([log] if log else [])
    if log:
        try:
            os.remove(log)
        except OSError:
            pass
    return result


def probe_bytes(slowest_link_gbps: Optional[float]) -> int:
    """The all-reduce's size a device: ALL_REDUCE_BYTES, less where the slowest link measured would take more
    than a quarter of a second a repeat (the probe measures; it must not outlast the doctor's deadline)."""
    if not slowest_link_gbps:
        return ALL_REDUCE_BYTES
    fits = int(slowest_link_gbps * 1e9 / 8 * 0.25)
    return max(MIN_BYTES, min(ALL_REDUCE_BYTES, fits))


def verdicts(
    results: Dict[str, Dict[str, Any]], failed: Dict[str, str], declared_gbps: float = 0.0, fabric: str = "ethernet"
) -> List[Dict[str, Any]]:
    """Checks: nodes whose JAX process did not join or finish, the group's bus bandwidth (against the declared
    bandwidth, where one is declared), and on GPUs what NCCL's own log says."""
    fix = (
        "open the xla_grpc range (the coordinator) and the ephemeral range (NCCL, gloo) between members "
        "(python -m alpa_job.cluster.firewall), and see the link checks: a very slow link outlasts the probe"
    )
    out = [
        check("collective", ip, False, "the all-reduce probe did not finish on %s: %s" % (ip, why), fix)
        for ip, why in sorted(failed.items())
    ]
    if not results or failed:
        return out
    first = results[sorted(results)[0]]
    gbps = network_probe.bus_gbps(first)
    detail = "all-reduce of %s a device over %d %s device(s) on %d node(s): %.3g ms, bus bandwidth %s Gb/s" % (
        human_bytes(first["bytes"]),
        first["devices"],
        first["backend"],
        len(results),
        first["seconds"] * 1e3,
        "%.3g" % gbps if gbps is not None else "-",
    )
    slow = bool(gbps is not None and declared_gbps and gbps < 0.5 * declared_gbps)
    out.append(
        check(
            "collective",
            None,
            not slow,
            detail + (" (declared %.3g Gb/s)" % declared_gbps if declared_gbps else ""),
            "see the link checks and NCCL's transports above: a collective well below the declared "
            "bandwidth usually runs on sockets or a slow link",
        )
    )
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
