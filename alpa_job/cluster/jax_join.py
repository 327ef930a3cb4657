"""Joining the JAX processes of a job: jax.distributed, bounded, and refused where this jax cannot really
join them. The training job's processes (launch.jax_process) and the doctor's all-reduce probe join the same way.

jax is imported inside the call, so this module imports where it is not installed.
"""

from __future__ import annotations

from typing import Optional

from alpa_job.errors import KitError

HEARTBEAT_TIMEOUT_S = 30  # a peer silent this long ends the others (backstop: the driver kills them first)


def init_distributed(coordinator: Optional[str], num_processes: int, process_id: int, timeout_s: int = 60) -> None:
    """Join the JAX processes of a multi-host job (no-op for one process); before jax opens a device."""
    if num_processes <= 1:
        return
    import inspect

    import jax

    # Each bound where this jax has it (0.4.13, the newest on Python 3.9, has neither keyword; the
    # driver's own deadline on the processes' first report is then the only bound).
    accepted = inspect.signature(jax.distributed.initialize).parameters
    bounds = {"initialization_timeout": timeout_s, "heartbeat_timeout_seconds": HEARTBEAT_TIMEOUT_S}  # never block forever on a dead peer
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        **{k: v for k, v in bounds.items() if k in accepted},
    )
    # Old jax on CPU (0.4.13) "joins" and then keeps each process on its own devices: the job would
    # train N unrelated replicas and report one. Refuse that instead.
    if jax.process_count() != num_processes:
        raise KitError(
            f"jax {jax.__version__} on {jax.default_backend()} did not join the {num_processes} JAX "
            f"processes into one device set (jax.process_count() = {jax.process_count()}); multi-host "
            "training needs a jax whose backend supports several processes (the kit's modern image, or GPUs)"
        )
