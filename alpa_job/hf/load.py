"""A checkpoint's weights made straight into the parameters' shardings: each device's shard is read from its
tensor's slice alone (jax.make_array_from_callback), so no process holds more of the model than its devices
do, and a tensor is converted to the parameter's dtype one slice at a time."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import jax

from alpa_job.hf import layout
from alpa_job.hf.checkpoint import HfCheckpoint


def _path(keys) -> Tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in keys)


def read_params(checkpoint: HfCheckpoint, weights: Any, abstract_params: Any, model_name: str) -> Any:
    """The parameters (the tree of `abstract_params`: ShapeDtypeStructs with shardings) from the checkpoint."""
    layout.check_fits(checkpoint, weights, model_name)  # the driver checked it too; a node may see another copy
    leaves, tree = jax.tree_util.tree_flatten_with_path(abstract_params)
    layout.check_covers(weights, [_path(keys) for keys, _ in leaves], model_name)
    tensors = layout.by_path(weights)

    def made(keys, leaf):
        tensor = tensors[_path(keys)]
        seen: Dict[Any, Any] = {}  # devices holding the same slice (replicas) read it once

        def slice_of(index):
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in seen:
                seen[key] = layout.read_slice(checkpoint, tensor, tuple(leaf.shape), index).astype(leaf.dtype)
            return seen[key]

        return jax.make_array_from_callback(tuple(leaf.shape), leaf.sharding, slice_of)

    return jax.tree_util.tree_unflatten(tree, [made(keys, leaf) for keys, leaf in leaves])
