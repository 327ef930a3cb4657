"""One JAX process of a job on Ray: the actor (`JaxProcess`) that each chosen node runs.

It says who it is (so a loss can be named after the process is gone), answers the driver's step
polls from a second thread, takes part in the shared --out check, and trains: process 0 waits for
the previous attempt's coordinator port to be free, then the one training loop runs.

Ray is imported when the actor class is first made, so this module imports where Ray is absent.
"""
from __future__ import annotations

import socket
import time
from typing import Any, Dict, List, Optional, Tuple

from alpa_job.launch import failures, shared_out

PORT_FREE_TIMEOUT_S = 30.0  # process 0 waits for the last attempt's coordinator to release the port


def wait_port_free(port: int, timeout_s: float = PORT_FREE_TIMEOUT_S) -> None:
    """Until this node can bind `port` (the previous attempt's coordinator, just killed, releases it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # jax.distributed's own error will then name the port
            time.sleep(0.25)
        finally:
            s.close()


_ACTOR_CLASS = None


def actor_class():
    """The JaxProcess actor class (made once: Ray registers each class it is given)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = _make_actor_class()
    return _ACTOR_CLASS


def _make_actor_class():
    import ray

    @ray.remote(num_cpus=1, max_concurrency=2)  # a 2nd thread answers step polls while the 1st trains
    class JaxProcess:
        def __init__(self):
            self.step: Optional[int] = None

        def describe(self, index: int) -> Dict[str, Any]:
            return failures.describe_self(index)

        def current_step(self) -> Optional[int]:
            return self.step

        def write_probe(self, out: str, token: str, index: int) -> None:
            shared_out.write_probe(out, token, index, socket.gethostname())

        def missing_probes(self, out: str, token: str, count: int) -> List[int]:
            return shared_out.missing_probes(out, token, count)

        def trajectory(self, cfg, run_start: int, resumed_from: int) -> Tuple[int, int]:
            from alpa_job.data import load_dataset, plan_epoch
            from alpa_job.launch.recovery import samples_in_steps

            epoch = plan_epoch(load_dataset(cfg).num_samples, cfg.batch_size, cfg.remainder)
            return samples_in_steps(epoch.steps, epoch.full_batches, epoch.remainder, epoch.policy,
                                    cfg.batch_size, run_start, resumed_from)

        def train(self, cfg, process_id: int, num_processes: int, coordinator: Optional[str],
                  channel=None) -> Any:
            from alpa_job import progress
            from alpa_job.train.loop import train_process

            def on_step(step: int) -> None:
                self.step = step

            progress.send_to(channel)  # process 0 feeds the driver's display; the others keep quiet
            if process_id == 0 and coordinator:
                wait_port_free(int(coordinator.rpartition(":")[2]))
            return train_process(cfg, process_id, num_processes, coordinator, on_step=on_step)

    return JaxProcess
