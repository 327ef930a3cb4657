"""Emulated CPU devices: XLA reads how many from XLA_FLAGS once, when jax starts, so this is set before
anything imports jax (the launcher calls it first, then imports the training loop, which imports jax)."""

from __future__ import annotations

import os
import sys


def ensure_cpu_devices(count: int) -> None:
    """Emulate `count` CPU devices; nothing once jax is imported in this process (its caller's devices stand)."""
    if "jax" in sys.modules:
        return
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [flag])
