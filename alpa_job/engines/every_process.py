"""A barrier for a job's JAX processes before a program that spans them runs for the first time.

The first such program sets up the processes' CPU collectives (Gloo) with a fixed 30 s rendezvous: a
process still compiling (a colder cache, a busier host) would miss it and fail the run with Gloo's
DEADLINE_EXCEEDED. Waiting here first moves every process to the rendezvous together. The wait is the
coordination service's barrier (no collective, so no Gloo); a process that never arrives is the
watchdog's and the driver's to name, so the timeout is long.
"""

from __future__ import annotations

import jax

# How long a process that has compiled waits for the slowest (a large model's compile takes minutes).
TIMEOUT_S = 1800
_asked: dict = {}  # any_process's calls a key, so that a barrier's name is used once a process


def wait(key: str) -> None:
    """Every process of the job calls this once with the same `key` (a key is used once a process); no-op
    in a single process."""
    if jax.process_count() == 1:
        return
    try:
        from orbax.checkpoint import multihost

        barrier = multihost.get_barrier_sync_fn()
    except (ImportError, AttributeError):  # an older orbax (the Python 3.9 stack) has no such barrier
        return
    barrier(key=key, timeout_ms=TIMEOUT_S * 1000)


def any_process(flag: bool, key: str) -> bool:
    """Whether `flag` holds on any process of the job: a decision every process must take alike (which program
    to run), from facts each process finds on its own (its memory, its cache). Every process calls this with
    the same `key`, as `wait`; one process: its own flag."""
    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    _asked[key] = _asked.get(key, 0) + 1  # every process asks in the same order: the same barrier name
    wait(f"{key}-{_asked[key]}")  # the first collective's rendezvous: every process at once
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))
