"""A GPU memory pool sized by the last identical run, so that a warm start does not wait for most of the card.

JAX's GPU allocator reserves its whole pool (75 % of the card by default) at a process's first buffer, and the
driver takes time in proportion to the bytes: on an H200 that is about 1.7 s for the default share, and a warm
start (its step loaded from the step store) waits for it before the state can be made. A run that needs far less
does not need all of it at once. So where an earlier identical run (same settings that reach the step, same XLA
and JAX environment, same visible devices) left its measured peak in the compile cache, the next one lets the
allocator grow its pool instead (XLA_PYTHON_CLIENT_PREALLOCATE=false, the same limit) and reserves that peak in
one piece as soon as the devices are open, beside the imports and the step's load: the step and the state then
come from one region, and anything beyond it grows on demand up to the same limit.

Nothing changes where the user chose the allocator's behaviour (XLA_PYTHON_CLIENT_PREALLOCATE,
XLA_PYTHON_CLIENT_ALLOCATOR or TF_GPU_ALLOCATOR set), where no compile cache is in use, or where no earlier run
left a peak: JAX's default reservation then stands. The hint is only a size: a wrong one costs the time a
region takes to grow, never a different program or limit.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Tuple

from alpa_job.engines import compile_cache, executable_store

GROW = executable_store.ALLOCATOR_GROWTH  # the one variable this module sets (the step store's key leaves it out)
USER_CHOICES = (GROW, "XLA_PYTHON_CLIENT_ALLOCATOR", "TF_GPU_ALLOCATOR")
MARGIN = 1.05  # the peak's share the reservation adds for the allocator's rounding and the input's buffers
_reserved: Dict[str, Tuple[int, int]] = {}  # hint file -> (the peak it held, the bytes reserved from it)


def _key(config) -> str:
    """What decides a run's device memory, as far as the process knows before its devices open."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    text = json.dumps([executable_store.step_settings(config), executable_store.step_environment(), visible], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def hint_path(config) -> Optional[str]:
    folder = compile_cache.resolve(getattr(config, "compile_cache", None))
    # Beside the stored steps: the same cache, the same lifetime.
    return os.path.join(folder, executable_store.FOLDER, f"pool-{_key(config)}.json") if folder else None


def choose(config) -> Optional[int]:
    """Before the devices open: the bytes to reserve a device (and the allocator told to grow), or None to keep
    JAX's default reservation."""
    if any(name in os.environ for name in USER_CHOICES):
        return None
    path = hint_path(config)
    try:
        with open(path) as f:
            peak = int(json.load(f)["peak_bytes"])
    except (TypeError, OSError, ValueError, KeyError):
        return None
    if peak <= 0:
        return None
    os.environ[GROW] = "false"
    _reserved[path] = (peak, int(peak * MARGIN))
    return _reserved[path][1]


def first_buffers(devices: List[Any], nbytes: Optional[int] = None) -> None:
    """The first buffer on each device, all devices at once (each allocation is its own call into the driver),
    freed at once: a scalar, where the allocator then reserves JAX's default pool, or `nbytes` (at most the
    allocator's limit, less a little) on each GPU, where `choose` told it to grow: it keeps the region."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from alpa_job.engines import memory_fit

    def one(device) -> None:
        if not nbytes or device.platform != "gpu":
            jax.device_put(np.zeros((), np.int32), device).block_until_ready()
            return
        limit = memory_fit.limit_of(device) or nbytes
        with jax.default_device(device):
            jnp.empty((max(1, min(nbytes, int(limit) - 2**26)),), jnp.uint8).block_until_ready()

    with concurrent.futures.ThreadPoolExecutor(len(devices), thread_name_prefix="first-buffer") as pool:
        list(pool.map(one, devices))


def remember(config, peak_bytes: Optional[int], platform: str) -> None:
    """After a GPU run: its measured peak, for the next identical run's reservation. The allocator's peak counts
    this run's own reservation: where nothing went past it, the hint it came from stands (else each run would
    add the margin again)."""
    path = hint_path(config)
    if not path or not peak_bytes or platform != "gpu":
        return
    hinted, reserved = _reserved.get(path, (0, 0))
    if peak_bytes <= reserved:
        peak_bytes = hinted
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"peak_bytes": int(peak_bytes)}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a hint that cannot be written only leaves the next run JAX's default reservation
