"""One JAX process of a job on Ray: the actor (`JaxProcess`) that each chosen node runs.

It says who it is (so a loss can be named after the process is gone), answers the driver's step
polls and its proposals of a step to stop at (preemption: train/stop.py) from a second thread, takes part in
the shared --out check, and trains: process 0 waits for the previous attempt's coordinator port to be free,
every process joins the others (`init_distributed`: jax.distributed, before any device is opened), then the
one training loop runs on the joined process.

Ray and jax are imported where used, so this module imports where neither is installed.
"""

from __future__ import annotations

import functools
import socket
import time
from typing import Any, Dict, List, Optional, Tuple

from alpa_job.cluster.jax_join import init_distributed  # noqa: F401 - the actor's, and its callers' name for it
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


@functools.lru_cache(maxsize=None)
def actor_class():
    """The JaxProcess actor class (made once: Ray registers each class it is given)."""
    import ray

    @ray.remote(num_cpus=1, max_concurrency=2)  # a 2nd thread answers step polls while the 1st trains
    class JaxProcess:
        def __init__(self):
            from alpa_job.train.stop import StopPoint

            self.step: Optional[int] = None
            self.stop = StopPoint()  # the driver's preemption reaches the loop through it

        def describe(self, index: int) -> Dict[str, Any]:
            return failures.describe_self(index)

        def current_step(self) -> Optional[int]:
            return self.step

        def propose_stop(self, at: int) -> Optional[int]:
            return self.stop.propose(at)

        def confirm_stop(self, at: int) -> None:
            self.stop.confirm(at)

        def write_probe(self, out: str, token: str, index: int) -> None:
            shared_out.write_probe(out, token, index, socket.gethostname())

        def missing_probes(self, out: str, token: str, count: int) -> List[int]:
            return shared_out.missing_probes(out, token, count)

        def trajectory(self, cfg, run_start: int, resumed_from: int) -> Tuple[int, int]:
            from alpa_job.data import plan_epoch
            from alpa_job.data.open import open_source
            from alpa_job.launch.recovery import samples_in_steps

            epoch = plan_epoch(len(open_source(cfg)), cfg.batch_size, cfg.remainder)
            return samples_in_steps(epoch.steps, epoch.full_batches, epoch.remainder, epoch.policy, cfg.batch_size, run_start, resumed_from)

        def train(self, cfg, process_id: int, num_processes: int, coordinator: Optional[str], channel=None) -> Any:
            from alpa_job.progress.channel import send_to
            from alpa_job.train.loop import train_process

            def on_step(step: int) -> None:
                self.step = step

            send_to(channel)  # process 0 feeds the driver's display; the others keep quiet
            if process_id == 0 and coordinator:
                wait_port_free(int(coordinator.rpartition(":")[2]))
            # NCCL's settings and its log (its transports, for the report: train/own_network.py), in every
            # process: whether this one drives several GPUs is known only once jax has started, and NCCL reads
            # its settings once. A process that never starts NCCL (CPU, one GPU) writes no file.
            from alpa_job.cluster.network_probe import prepare_nccl

            prepare_nccl()
            init_distributed(coordinator, num_processes, process_id)  # before the loop touches a device
            return train_process(cfg, coordinator, on_step=on_step, stop=self.stop)

    return JaxProcess
