"""One JAX process per Ray node: pin an actor to each node, start jax.distributed, train.

The coordinator is process 0's node's OWN IP (as Ray knows it, from --node-ip-address) and the
port from the cluster spec - never a default-route guess, never a random port the firewall closes.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List

from alpa_job.cluster import ray_api
from alpa_job.cluster.worker_path import worker_pythonpath
from alpa_job.errors import EXIT_TIMEOUT, KitError

ACTOR_START_TIMEOUT_S = 120


def training_nodes() -> List[ray_api.RayNode]:
    """Alive nodes with a CPU to spare, process 0's first.

    Process 0 (the coordinator) goes on the driver's node when it is a member: that is the head
    under `ray job submit`, whose address the user already knows.
    """
    import ray

    here = ray.util.get_node_ip_address()
    nodes = [n for n in ray_api.alive_nodes() if n.cpus() >= 1]
    return sorted(nodes, key=lambda n: (n.ip != here, n.ip))


def _worker_env(config, spec) -> Dict[str, str]:
    env = {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={config.devices}",
        "PYTHONPATH": worker_pythonpath(),
    }
    env.update(spec.xla_env())
    return env


def run_on_nodes(config, spec) -> List[Dict[str, Any]]:
    """Train with one JAX process per node. `spec`: the ClusterSpec the entry point resolved."""
    import ray

    nodes = training_nodes()
    count = config.processes or len(nodes)
    if count > len(nodes):
        raise KitError(f"--processes {count} but only {len(nodes)} alive Ray nodes have a free CPU; "
                       f"use --processes {len(nodes)} or add nodes")

    @ray.remote(num_cpus=1)
    class JaxProcess:
        def node_ip(self) -> str:
            return ray.util.get_node_ip_address()

        def train(self, cfg, process_id: int, num_processes: int, coordinator: str) -> Dict[str, Any]:
            from alpa_job.train import train_process

            return train_process(cfg, process_id, num_processes, coordinator)

    env = _worker_env(config, spec)
    actors = [JaxProcess.options(runtime_env={"env_vars": env}, **ray_api.pin_to_node(n.ip)).remote()
              for n in nodes[:count]]
    try:
        ips = ray.get([a.node_ip.remote() for a in actors], timeout=ACTOR_START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise KitError(f"JAX processes did not start on all {count} nodes within {ACTOR_START_TIMEOUT_S} s; "
                       "run python -m alpa_job doctor to find the node that cannot run tasks", EXIT_TIMEOUT) from None
    coordinator = f"{ips[0]}:{spec.jax_coordinator_port}" if count > 1 else None
    print(f"[alpa_job] {count} JAX process(es) on {', '.join(ips)}; coordinator {coordinator or '-'}",
          file=sys.stderr, flush=True)
    futures = [a.train.remote(config, i, count, coordinator) for i, a in enumerate(actors)]
    try:
        return ray.get(futures)
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, KitError):  # a user error found on a worker: same one line as locally
            raise KitError(str(cause), cause.exit_code) from None
        raise
    except ray.exceptions.RayActorError as err:
        raise KitError(f"a JAX process died ({str(err).splitlines()[0]}); read its log under "
                       "/tmp/ray/session_latest/logs/ on that node", 1) from None
