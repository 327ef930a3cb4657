"""Where the job runs: join a Ray cluster, start a local one, or (benchmarks, tests) no Ray at all.

The default follows where the job runs: under `ray job submit` RAY_ADDRESS is set and the job
joins that cluster; elsewhere it starts an in-process local Ray (the embedded default).
The address checks and the bounded join itself are ray_api's (one place for each).
"""

from __future__ import annotations

import os
from typing import Optional

from alpa_job.cluster import ray_api
from alpa_job.cluster.ray_api import LOCAL

NO_RAY = "none"  # run in this process without Ray (benchmarks, machines without Ray)


def resolve_address(address: Optional[str]) -> str:
    """--address, else RAY_ADDRESS, else a local in-process Ray (the job's default; the doctor's is auto)."""
    return ray_api.normalize_address(address, default=LOCAL) if address != NO_RAY else NO_RAY


def connect(
    address: str,
    engine: str,
    num_cpus: Optional[int] = None,
    spec=None,
    timeout_s: float = ray_api.JOIN_TIMEOUT_S,
    log_to_driver: bool = True,
) -> str:
    """ray.init for `address` (bounded); returns a description of what was joined. `log_to_driver`
    False: the workers' output stays in their Ray logs (the job's progress comes through progress/channel.py)."""
    address = ray_api.normalize_address(address, spec, default=LOCAL)
    if engine == "alpa":
        from alpa_job.engines.alpa_guards import refuse_ray_client  # pure checks, no `import alpa`

        refuse_ray_client(address)
    if address == LOCAL:
        return ray_api.join_ray(
            LOCAL,
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            object_store_memory=200 * 2**20,
            log_to_driver=log_to_driver,
            configure_logging=False,
        )
    return ray_api.join_ray(address, timeout_s, log_to_driver=log_to_driver, configure_logging=False)
