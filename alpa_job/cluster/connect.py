"""Where the job runs: join a Ray cluster, start a local one, or (bench/tests) no Ray at all.

The default follows where the job runs: under `ray job submit` RAY_ADDRESS is set and the job
joins that cluster; elsewhere it starts an in-process local Ray (the embedded default).
"""
from __future__ import annotations

import os
import socket
from typing import Optional

from alpa_job.errors import EXIT_TIMEOUT, KitError

LOCAL = "local"
NO_RAY = "none"  # run in this process without Ray (benchmarks, machines without Ray)
CONNECT_TIMEOUT_S = 10.0


def resolve_address(address: Optional[str]) -> str:
    if address:
        return address
    return os.environ.get("RAY_ADDRESS") or LOCAL


def check_reachable(host_port: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast (and name the fix) when a Ray GCS address does not answer on TCP."""
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise KitError(f"--address {host_port!r} is not HOST:PORT; use local, auto, or the head's GCS address "
                       "like 10.0.0.1:6379")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except socket.timeout:
        raise KitError(f"Ray GCS at {host_port} did not answer within {timeout_s:.0f} s; check that the head is up "
                       f"and that port {port} is open to this host (python -m alpa_job doctor)", EXIT_TIMEOUT) from None
    except OSError as err:
        raise KitError(f"cannot reach Ray GCS at {host_port} ({err.strerror or err}); start the head "
                       f"(ray start --head) or fix --address", EXIT_TIMEOUT) from None


def connect(address: str, engine: str, num_cpus: Optional[int] = None) -> str:
    """ray.init for `address`; returns a description of what was joined."""
    if address.startswith(("http://", "https://")):
        raise KitError(f"--address {address} is the dashboard/jobs URL; submit with `ray job submit --address "
                       f"{address} -- python -m alpa_job ...` or pass the GCS address HOST:6379")
    if address.startswith("ray://") and engine == "alpa":
        raise KitError("Alpa does not work over Ray Client (ray://, Alpa issue #886); run the driver on a cluster "
                       "node: ray job submit --address http://HEAD:8265 -- python -m alpa_job ...")
    import ray

    if ray.is_initialized():
        return "already connected"
    if address == LOCAL:
        ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
                 object_store_memory=200 * 2**20, log_to_driver=True, configure_logging=False)
        return "local Ray (in-process)"
    if address not in ("auto",) and not address.startswith("ray://"):
        check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=True, configure_logging=False)
    except ConnectionError as err:
        raise KitError(f"cannot join Ray at {address!r} ({str(err).splitlines()[0]}); start a cluster or use "
                       "--address local", EXIT_TIMEOUT) from None
    return f"Ray cluster at {address}"
