"""A run over several processes, or over several GPUs of one process, measures the links it runs on before its
first step: an all-reduce over every device (its bus bandwidth, into the report, inspect and TensorBoard) and,
on GPUs, the transports NCCL chose (each process's own, into its row of the report: NVLink/P2P within a node,
NET/... across nodes). A cluster that declares InfiniBand or RoCE while NCCL runs on sockets hears it in the
progress output then, not hours later from a slow run."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from alpa_job.progress.events import metrics, note

# Each device's buffer: on GPUs large enough for the bus bandwidth (a few ms); on CPU hosts, whose
# collectives run on the same cores as everything else, small enough to cost a fraction of a second.
PROBE_BYTES = {"gpu": 32 << 20, "cpu": 4 << 20}
PROBE_REPEATS = 3


def worth_measuring(backend: str, process_count: int, device_count: int) -> bool:
    """Several processes always talk over a link; one process only when it drives several GPUs (NCCL over
    NVLink or PCIe). One process's CPU devices share its memory: nothing there is a link."""
    return process_count > 1 or (backend == "gpu" and device_count > 1)


def measure(config, process_count: int) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]]]:
    """(the timed all-reduce, this process's NCCL transports and verdicts); (None, None) where no link is used."""
    import jax

    from alpa_job.cluster import network_probe

    backend = jax.default_backend()
    if not worth_measuring(backend, process_count, jax.device_count()):
        return None, None
    measured = network_probe.time_all_reduce(PROBE_BYTES.get(backend, PROBE_BYTES["gpu"]), PROBE_REPEATS)
    note(
        f"[alpa_job] network: all-reduce of {measured['bytes'] >> 20} MiB a device over "
        f"{measured['devices']} {backend} device(s): {measured['bus_gbps']} Gb/s bus bandwidth"
    )
    metrics(0, {"network/all_reduce_bus_gbps": measured["bus_gbps"]})
    nccl = _nccl(config) if backend == "gpu" else None
    return measured, nccl


def _nccl(config) -> Optional[Dict[str, Any]]:
    """What NCCL's own lines of this process say (they exist once the probe's all-reduce built its
    communicators)."""
    from alpa_job.cluster.doctor import nccl_log
    from alpa_job.cluster import network_probe

    path = network_probe.own_nccl_log()
    if not os.path.exists(path):
        return None  # the user set NCCL_DEBUG: their output, not read here
    summary = nccl_log.parse_lines(network_probe.nccl_lines([path]))
    problems = nccl_log.verdicts(summary, _fabric(config))
    for line in problems:
        note(f"[alpa_job] network: {line}")
    return {"transports": nccl_log.transports_line(summary), "channels": summary.channels(), "verdicts": problems, "log": path}


def _fabric(config) -> str:
    from alpa_job.cluster.spec import load_spec

    try:
        return load_spec(getattr(config, "cluster_spec", None)).network.fabric
    except Exception:  # noqa: BLE001 - a spec this node cannot read: the default fabric, as the doctor's
        return "ethernet"
