"""A JAX program's arrays and shardings -> the engine-neutral plan (a record producer, like alpa_dump.py).

The JAX engine's report and `alpa_job.inspect.plan_of` (any user's own jitted step) both read
shardings through here, so the two give the same leaf paths, per-dimension mesh axes and labels.
jax is imported inside the functions: the record package imports with no engine installed.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from alpa_job.errors import KitError
from alpa_job.record import plan as plan_model

DimAxes = List[Tuple[str, ...]]


def path_text(path) -> str:
    """A pytree key path as the report writes it: 'params/Dense_0/kernel', 'opt_state/0/mu/...'."""
    parts = []
    for key in path:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return "/".join(parts)


def flatten(tree, is_leaf: Optional[Callable[[Any], bool]] = None) -> List[Tuple[str, Any]]:
    """(path text, leaf) for every leaf of `tree`."""
    import jax

    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_text(p), leaf) for p, leaf in leaves]


def spec_axes(spec, mesh) -> DimAxes:
    """Per array dimension, the mesh axes (of size > 1) that split it."""
    out = []
    for entry in spec:
        names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        out.append(tuple(n for n in names if mesh.shape[n] > 1))
    return out


def sharding_axes(sharding, shape: Sequence[int], mesh) -> Tuple[DimAxes, str]:
    """(per dimension the mesh axes that split it, the sharding as text) of one array on `mesh`.

    A NamedSharding over this mesh's axes is read from its spec. Any other sharding (another mesh
    of the same devices, XLA's own choice on older jax) is read from which slice each device holds.
    """
    from jax.sharding import PartitionSpec

    spec = getattr(sharding, "spec", None)
    other = getattr(sharding, "mesh", None)
    if spec is not None and (other is None or _same_axes(other, mesh)):
        dim_axes = spec_axes(spec, mesh)
    elif sharding is None or _replicated(sharding):
        return [()] * len(shape), str(spec if spec is not None else PartitionSpec())
    else:
        dim_axes = _axes_from_devices(sharding, shape, mesh)
        spec = PartitionSpec(*[None if not a else (a[0] if len(a) == 1 else a) for a in dim_axes])
    dim_axes = list(dim_axes) + [()] * (len(shape) - len(dim_axes))
    return dim_axes, str(spec)


def _same_axes(one, other) -> bool:
    return tuple(one.axis_names) == tuple(other.axis_names) and dict(one.shape) == dict(other.shape)


def _replicated(sharding) -> bool:
    try:
        return bool(sharding.is_fully_replicated)
    except Exception:  # noqa: BLE001 - a sharding type that cannot say
        return False


def _axes_from_devices(sharding, shape: Sequence[int], mesh) -> DimAxes:
    """Which mesh axes move each dimension's slice: step one device along each axis and compare."""
    index = sharding.devices_indices_map(tuple(shape))
    devices = mesh.devices
    if not set(index) <= set(devices.flat):
        raise KitError(
            f"an array is placed on devices outside the mesh {dict(mesh.shape)}; pass mesh= the jax.sharding.Mesh the program runs on"
        )
    origin = index[devices[(0,) * devices.ndim]]
    moves: List[List[Tuple[int, str]]] = [[] for _ in shape]
    for position, name in enumerate(mesh.axis_names):
        if devices.shape[position] == 1:
            continue
        step = [0] * devices.ndim
        step[position] = 1
        moved = index[devices[tuple(step)]]
        for dim in range(len(shape)):
            distance = abs((moved[dim].start or 0) - (origin[dim].start or 0))
            if distance:
                moves[dim].append((distance, name))
    # The axis that moves a slice furthest is the dimension's outer split (first in a spec).
    return [tuple(name for _d, name in sorted(dim, reverse=True)) for dim in moves]


def dtype_text(dtype) -> Tuple[str, int]:
    """(the dtype's name, bytes per element); a typed PRNG key counts its own item size."""
    import numpy as np

    try:
        d = np.dtype(dtype)
    except TypeError:  # jax's extended dtypes (PRNG keys) are not numpy dtypes
        return str(dtype), int(getattr(dtype, "itemsize", 0) or 0)
    return str(d), d.itemsize


def plan_leaves(abstract_tree, shardings, mesh, prefix: str = "", is_leaf: Optional[Callable[[Any], bool]] = None) -> List[plan_model.Leaf]:
    """The plan's leaves of one tree of arrays (anything with .shape and .dtype), paired by path with
    a tree of shardings of the same structure; `prefix` goes before each path ('batch/x')."""
    shard_by_path = dict(flatten(shardings, is_leaf=_is_sharding_or_none))
    out = []
    for path, leaf in flatten(abstract_tree, is_leaf=is_leaf):
        shape, dtype = tuple(_aval(leaf).shape), _aval(leaf).dtype
        dim_axes, spec = sharding_axes(shard_by_path[path], shape, mesh)
        name, itemsize = dtype_text(dtype)
        full = "/".join(p for p in (prefix, path) if p)
        out.append(plan_model.Leaf(full, shape, name, (0,), tuple(dim_axes), spec, itemsize))
    return out


def _is_sharding_or_none(x) -> bool:
    from jax.sharding import Sharding

    return x is None or isinstance(x, Sharding)


def _aval(leaf):
    """An array-like's shape and dtype holder (a Compiled program's ArgInfo keeps them in its aval)."""
    for attr in ("_aval", "aval"):
        inner = getattr(leaf, attr, None)
        if inner is not None and hasattr(inner, "shape"):
            return inner
    return leaf


def build_plan(mesh, state: Sequence[plan_model.Leaf], batch: Sequence[plan_model.Leaf]) -> plan_model.ParallelPlan:
    """One mesh (id 0) with its batch axes -- the mesh axes that split the batch's rows (first
    dimension), which decide DP vs ZeRO -- holding the state and batch leaves."""
    rows: List[str] = []
    for leaf in batch:
        for axis in leaf.dim_axes[0] if leaf.dim_axes else ():
            if axis not in rows:
                rows.append(axis)
    plan_mesh = plan_model.Mesh(0, tuple(mesh.devices.shape), tuple(mesh.axis_names), tuple(rows))
    return plan_model.ParallelPlan((plan_mesh,), tuple(state), tuple(batch))


def memory_analysis(compiled) -> Optional[Dict[str, int]]:
    """XLA's memory analysis of a compiled program (per device), with a peak estimate; None where
    the backend does not implement it."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes", "generated_code_size_in_bytes")
    out = {f: int(getattr(m, f, 0) or 0) for f in fields}
    out["peak_estimate_bytes"] = (
        out["argument_size_in_bytes"] + out["output_size_in_bytes"] + out["temp_size_in_bytes"] - out["alias_size_in_bytes"]
    )
    return out
