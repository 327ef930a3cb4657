"""Emulated CPU devices: XLA reads how many from XLA_FLAGS once, when jax starts, so this is set before
anything imports jax (the launcher calls it first, then imports the training loop, which imports jax)."""

from __future__ import annotations

import os
import sys
from typing import Optional

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_device_count(count: int, xla_flags: Optional[str] = None) -> str:
    """`xla_flags` (default: this process's $XLA_FLAGS) with its device count replaced by `count`: every other
    flag is the user's and stays."""
    if xla_flags is None:
        xla_flags = os.environ.get("XLA_FLAGS", "")
    flags = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join(flags + [f"{DEVICE_COUNT_FLAG}={count}"])


def ensure_cpu_devices(count: int) -> None:
    """Emulate `count` CPU devices; nothing once jax is imported in this process (its caller's devices stand)."""
    if "jax" in sys.modules:
        return
    os.environ["XLA_FLAGS"] = with_device_count(count)
