"""Human units shared by training messages and the readers (no jax, no other kit module)."""

from __future__ import annotations

from typing import Optional


def human_bytes(n: Optional[float]) -> str:
    """1536 -> '1.5 KiB' (binary units, as XLA and the device budgets count)."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
