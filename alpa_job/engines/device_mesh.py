"""The step's mesh of this process's view of the job's devices (kept light: the step store's load ahead builds
it before the engine's own modules are imported)."""

from __future__ import annotations

from typing import Tuple

import jax
import numpy as np
from jax.sharding import Mesh

from alpa_job.errors import KitError
from alpa_job.strategies import MESH_AXES


def make_mesh(mesh_shape: Tuple[int, int], axis_names: Tuple[str, str] = MESH_AXES) -> Mesh:
    """Devices in JAX's order, process-major: a row of a (hosts, devices per host) mesh is one host."""
    devices = jax.devices()
    need = mesh_shape[0] * mesh_shape[1]
    if need != len(devices):
        raise KitError(
            f"mesh {mesh_shape} needs {need} devices but {len(devices)} are visible; "
            f"use --devices {need} or a mesh that multiplies to {len(devices)}"
        )
    return Mesh(np.asarray(devices).reshape(mesh_shape), axis_names)
