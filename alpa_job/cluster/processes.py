"""One JAX process per Ray node: pin an actor to each node, start jax.distributed, train.

The coordinator is process 0's node's OWN IP (as Ray knows it, from --node-ip-address) and the
port from the cluster spec - never a default-route guess, never a random port the firewall closes.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List

from alpa_job.cluster.worker_path import worker_pythonpath
from alpa_job.errors import EXIT_TIMEOUT, KitError

ACTOR_START_TIMEOUT_S = 120


def alive_nodes() -> List[Dict[str, Any]]:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1]
    # Process 0 (the coordinator) on the driver's node when it is a member: that is the head
    # under `ray job submit`, whose address the user already knows.
    here = ray.util.get_node_ip_address()
    return sorted(nodes, key=lambda n: (n["NodeManagerAddress"] != here, n["NodeManagerAddress"]))


def _worker_env(config) -> Dict[str, str]:
    from alpa_job.cluster.spec import load_spec

    env = {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={config.devices}",
        "PYTHONPATH": worker_pythonpath(),
    }
    env.update(load_spec(config.cluster_spec).xla_env())
    return env


def run_on_nodes(config) -> List[Dict[str, Any]]:
    import ray

    from alpa_job.cluster.spec import load_spec

    nodes = alive_nodes()
    count = config.processes or len(nodes)
    if count > len(nodes):
        raise KitError(f"--processes {count} but only {len(nodes)} alive Ray nodes have a free CPU; "
                       f"use --processes {len(nodes)} or add nodes")
    spec = load_spec(config.cluster_spec)

    @ray.remote(num_cpus=1)
    class JaxProcess:
        def node_ip(self) -> str:
            return ray.util.get_node_ip_address()

        def train(self, cfg, process_id: int, num_processes: int, coordinator: str) -> Dict[str, Any]:
            from alpa_job.train import train_process

            return train_process(cfg, process_id, num_processes, coordinator)

    env = _worker_env(config)
    actors = [JaxProcess.options(resources={f"node:{n['NodeManagerAddress']}": 0.001},
                                 runtime_env={"env_vars": env}).remote() for n in nodes[:count]]
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
