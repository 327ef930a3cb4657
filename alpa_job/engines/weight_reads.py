"""Which dtype a model reads each parameter in: the dtype data parallelism's sharded update gathers it in.

Under `--strategy data` with the sharded update, the fp32 parameters stay split between steps (as the
optimizer state is), and each step begins by gathering them whole. A model that computes in bf16 casts
every dense weight to bf16 before its first use, so gathering the bf16 cast moves half the bytes of
gathering the fp32 weights, and gives the loss exactly the values it would compute from them. A
parameter the model also reads in full precision (an embedding lookup, a layer norm's scale) is gathered
as it is.

The answer comes from the loss's jaxpr, followed into the calls whose inner jaxpr takes the outer
operands in order. Any other use of a parameter counts as a full-precision read: an unknown construct
costs bytes, never a different number.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

# Primitives whose inner jaxpr (the param named here) receives the outer operands in order.
_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "scan": "jaxpr",
}


def _read_only_as(jaxpr, var, dtype) -> bool:
    """Whether every read of `var` in `jaxpr` (and in the calls it makes) is a cast to `dtype`."""
    if any(out is var for out in jaxpr.outvars):
        return False
    for eqn in jaxpr.eqns:
        for position, operand in enumerate(eqn.invars):
            if operand is not var:
                continue
            name = eqn.primitive.name
            if name == "convert_element_type" and np.dtype(eqn.params["new_dtype"]) == dtype:
                continue
            inner = eqn.params.get(_CALLS.get(name, ""))
            inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr or a Jaxpr
            if inner is not None and len(inner.invars) == len(eqn.invars) and _read_only_as(inner, inner.invars[position], dtype):
                continue
            return False
    return True


def gather_dtypes(model, params, batch_stats, example_batch, compute_dtype) -> Any:
    """A tree like `params`: `compute_dtype` where the model's loss reads that parameter only as
    `compute_dtype`, else the parameter's own dtype. Every argument may be arrays or ShapeDtypeStructs."""
    compute = np.dtype(compute_dtype)
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch_stats, example_batch))
    leaves, tree = jax.tree_util.tree_flatten(shapes[0])
    if all(leaf.dtype == compute for leaf in leaves):
        return tree.unflatten([leaf.dtype for leaf in leaves])  # nothing to narrow: no trace needed
    closed = jax.make_jaxpr(model.masked_loss)(*shapes)
    invars = closed.jaxpr.invars[: len(leaves)]  # the parameters come first
    return tree.unflatten([compute if _read_only_as(closed.jaxpr, var, compute) else leaf.dtype for leaf, var in zip(leaves, invars)])
