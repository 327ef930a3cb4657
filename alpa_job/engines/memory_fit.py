"""Memory before work: a run whose train state or step cannot fit its devices stops before the first step.

Two checks, each a one-line KitError naming the bytes and the way out:
  - `check_state_fits`: the state's bytes per device, from the abstract state and its shardings (known
    before anything compiles or allocates), against the device's memory;
  - `check_step_fits`: XLA's estimate for the compiled step (arguments + outputs + scratch - aliased),
    which adds gradients, activations and the batch, against the same budget.

The budget: a GPU's own allocator limit (`memory_stats()["bytes_limit"]`: what JAX may take of the card);
for CPU devices the host's available RAM (/proc/meminfo MemAvailable), which every emulated CPU device of
the process shares. Only FRACTION of it is counted as usable: the runtime, the input pipeline and XLA's
own buffers need the rest, and a run that passes by a hair is killed later, when it costs most.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from alpa_job import strategies
from alpa_job.errors import KitError

FRACTION = 0.9


def state_bytes_per_device(abstract_state: Any) -> int:
    """Bytes of the state one device holds: each leaf's shard (its sharding's shard shape) x its item size."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(abstract_state):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = tuple(sharding.shard_shape(shape))
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def host_available_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo (what the kernel can give without swapping), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_LIMITS: Dict[Tuple[str, int], int] = {}  # (platform, device id) -> its allocator's bytes_limit (remember_limits)


def remember_limits(devices: List[Any]) -> None:
    """Read each device's allocator limit now, before its first buffer: memory_stats() waits, holding the
    interpreter, while the allocator reserves its pool (loop._open_devices_early starts that on a worker
    thread), and the limit does not change afterwards."""
    for device in devices:
        limit = _stats(device).get("bytes_limit")
        if limit:
            _LIMITS[_key(device)] = int(limit)


def _key(device) -> Tuple[str, int]:
    return getattr(device, "platform", ""), getattr(device, "id", -1)


def _stats(device) -> dict:
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices and some runtimes keep no allocator statistics
        return {}


def limit_of(device) -> Optional[int]:
    """The device's allocator limit: as remembered before its first buffer, else as its statistics say now."""
    limit = _LIMITS.get(_key(device)) or _stats(device).get("bytes_limit")
    return int(limit) if limit else None


def budget(devices: List[Any]) -> Optional[Tuple[int, int, str]]:
    """(bytes available, devices sharing them, what they are in words) for this process's devices;
    None when nothing says (the check is then skipped, never guessed)."""
    limit = limit_of(devices[0])
    if limit:
        return limit, 1, f"JAX may take {_gb(limit)} of one {devices[0].device_kind}"
    if devices[0].platform != "cpu":
        return None
    available = host_available_bytes()
    if available is None:
        return None
    return available, len(devices), f"this host has {_gb(available)} of RAM available for this process's {len(devices)} CPU device(s)"


def check_state_fits(abstract_state: Any, strategy: str, mesh_shape: Tuple[int, ...], devices: Optional[List[Any]] = None) -> None:
    """Before compiling: the state (parameters + optimizer state) each device will hold fits."""
    need = state_bytes_per_device(abstract_state)
    _check(need, "the train state (parameters + optimizer state)", strategy, mesh_shape, devices, batch=False)


def check_step_fits(
    memory: Optional[dict],
    strategy: str,
    mesh_shape: Tuple[int, ...],
    devices: Optional[List[Any]] = None,
    stronger_remat: Sequence[str] = (),
    gather_layers: bool = False,
) -> None:
    """After compiling: XLA's estimate for one step (jax_program.memory_analysis's dict) fits.
    `stronger_remat`: the model's --remat policies that keep less than the one it runs with (a way out);
    `gather_layers`: --fsdp-gather layer would hold less of the gathered weights (another)."""
    need = (memory or {}).get("peak_estimate_bytes")
    if need:
        _check(
            int(need),
            "XLA's estimate for the train step (state, gradients, activations, batch)",
            strategy,
            mesh_shape,
            devices,
            batch=True,
            stronger_remat=stronger_remat,
            gather_layers=gather_layers,
        )


def _check(
    need: int,
    what: str,
    strategy: str,
    mesh_shape: Tuple[int, ...],
    devices: Optional[List[Any]],
    batch: bool,
    stronger_remat: Sequence[str] = (),
    gather_layers: bool = False,
) -> None:
    devices = devices if devices is not None else jax.local_devices()
    found = budget(devices)
    if found is None:
        return
    available, sharing, words = found
    if need * sharing <= FRACTION * available:
        return
    total = f" ({_gb(need * sharing)} for {sharing} devices)" if sharing > 1 else ""
    raise KitError(
        f"{what} needs {_gb(need)} per device{total} with --strategy {strategy} on mesh "
        f"{tuple(mesh_shape)}, and {words}, of which {int(FRACTION * 100)}% ({_gb(FRACTION * available)}) "
        f"counts as usable; {_ways_out(strategy, batch, stronger_remat, getattr(devices[0], 'platform', '') == 'gpu', gather_layers)}"
    )


def _ways_out(strategy: str, batch: bool, stronger_remat: Sequence[str] = (), gpu: bool = False, gather_layers: bool = False) -> str:
    ways = ["--fsdp-gather layer (holds a layer's gathered weights at a time, not every layer's)"] if gather_layers else []
    ways += [f"--remat {' / '.join(stronger_remat)} (keeps fewer activations)"] if stronger_remat else []
    ways += [f"--strategy {s.name} ({s.memory_relief})" for s in strategies.STRATEGIES.values() if s.memory_relief and s.name != strategy]
    if gpu and float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")) < 0.9:
        # JAX takes 75 % of a card by default: a run that misses by a little fits at 95 %.
        ways.append("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 in the environment (JAX then takes 95% of the card)")
    ways.append("fewer layers or a smaller model (--num-layers, --d-model / --hidden-dim)")
    if batch:
        ways.append("a smaller --batch-size")
    return "use " + ", ".join(ways[:-1]) + " or " + ways[-1]


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n < 1e12 else f"{n / 1e12:.2f} TB"
