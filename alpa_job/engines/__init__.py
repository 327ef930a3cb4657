"""Engines: the JAX engine (modern stack) and the Alpa engine (legacy image).

Engine packages (jax, alpa) are imported only inside the engine modules, so choosing an engine
here costs nothing on a machine that lacks one of them.
"""

from __future__ import annotations

import importlib.util

from alpa_job.errors import KitError


def alpa_available() -> bool:
    return importlib.util.find_spec("alpa") is not None


def resolve_engine(requested: str) -> str:
    """auto = alpa when it imports, else jax."""
    if requested == "auto":
        if alpa_available():
            try:
                import alpa  # noqa: F401  (importable is the test; a broken install falls back)

                return "alpa"
            except Exception:  # noqa: BLE001 - alpa needs its own CUDA jaxlib; anything else means no
                return "jax"
        return "jax"
    if requested == "alpa" and not alpa_available():
        raise KitError(
            "--engine alpa: the alpa package is not installed here; run inside the kit's Alpa image (docker/alpa) or use --engine jax"
        )
    return requested
