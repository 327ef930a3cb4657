"""fsdp's parameters gathered one layer at a time, as ZeRO-3 / PyTorch FSDP do.

Under fsdp each device holds a share of every parameter, and each layer needs its weights whole while it
runs. Left to itself, XLA gathers a weight once and keeps the gathered copy for the backward pass (the
matmul's gradient reads it): every layer's gathered weights are alive together between the forward and
the backward, so fsdp's peak is as large as data's, and a model whose gathered weights do not fit beside its
state share cannot train at any device count.

Here each call of the model's repeated layer class (`layer_class`) runs with a gradient of the kit's own:
- the layer is cut by data dependence into what it computes from its weights alone (casts, transposes)
  and the rest;
- forward: each device casts its share of the layer's weights to the dtype the model reads them in, the
  shares are gathered whole, and the layer runs; the backward keeps every activation the layer's own
  autodiff keeps, but not the gathered weights nor what was computed from them alone;
- backward: the weights are gathered again, and the gather's transpose reduce-scatters their gradients.

The forward's gather is tied by data to the layer's input (its share plus the input's first element times
zero, on each device its own part): it cannot run before the layers ahead of it, and it differs from the
backward's gather of the same weights, which XLA would otherwise merge with it into one copy held across
the step. A layer class run under a flax transform of its own (the model's `nn.remat`) is left to XLA: the
model's checkpoint already recomputes the weights' casts in the backward, so XLA gathers them again there.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from alpa_job.jax_compat import shard_map


def unsupported(record, model) -> Optional[str]:
    """Why `--strategy record.name` with `model` cannot gather per layer, in words for a note; None: it can."""
    if not record.gathers_layers:
        return f"--strategy {record.name} gathers no split weights"
    if model.layer_class is None:
        return f"--model {model.name} has no layer_class"
    if model.has_batch_stats:
        return f"--model {model.name} has BatchNorm statistics"
    if not hasattr(nn, "intercept_methods"):  # the Python 3.9 side's flax
        return "this flax cannot intercept a layer's call"
    return None


def starts_per_layer(config, record, model) -> bool:
    """Whether the step is first compiled with per-layer gathers: asked for, and possible."""
    return config.fsdp_gather == "layer" and unsupported(record, model) is None


class LayerGather:
    """Runs a model's loss with each call of `layer_class` gathering its own parameters."""

    def __init__(self, layer_class: type, mesh, rows: PartitionSpec, gather_dtypes, shardings):
        self.layer_class, self.mesh, self.rows = layer_class, mesh, rows  # rows: how activations split
        self.gather_dtypes = by_module_path(gather_dtypes)  # module path -> its params' dtypes as read
        self.shardings = by_module_path(shardings)  # module path -> its params' shardings in the state
        self.gathered_layers, self.under_own_remat = 0, False  # what the last trace found

    def run(self, loss: Callable, *args):
        """`loss(*args)` with every (outermost) call of the layer class gathering its weights itself. A call
        through a flax transform of the class (its own `nn.remat`) is left to XLA: inside the model's
        checkpoint the backward recomputes the weights' casts, so XLA gathers them again there itself, and a
        tie made inside that trace could not reach the next layer's."""
        inside, lifted = [False], [False]
        self.gathered_layers, self.under_own_remat = 0, False

        def intercept(next_fun, call_args, kwargs, context):
            module = context.module
            # Once the class is seen under a flax transform, every call of it is the transform's (which may
            # trace the call again later, outside its wrapper's call).
            if inside[0] or lifted[0] or not isinstance(module, self.layer_class):
                return next_fun(*call_args, **kwargs)
            if context.method_name != "__call__":  # a lifted transform's wrapper around the class's call
                lifted[0] = self.under_own_remat = True
                return next_fun(*call_args, **kwargs)
            inside[0] = True
            try:
                self.gathered_layers += 1
                return self._layer(module, call_args, kwargs)
            finally:
                inside[0] = False

        with nn.intercept_methods(intercept):
            return loss(*args)

    def _split_of(self, value) -> PartitionSpec:
        """How a layer's input or gradient is split: its rows as the batch's, where they divide evenly."""
        ways = 1
        for axis in self.rows[0] if isinstance(self.rows[0], tuple) else (self.rows[0],):
            ways *= self.mesh.shape[axis]
        return self.rows if value.ndim and value.shape[0] % ways == 0 else PartitionSpec()

    def _layer(self, module, call_args, kwargs):
        path = tuple(module.scope.path)
        shares = module.variables["params"]
        dtypes = self.gather_dtypes.get(path)
        unbound = module.clone(parent=None)
        arrays, rebuild = _split_static((call_args, kwargs))

        def apply(whole, arrays_now):
            a, k = rebuild(arrays_now)
            return unbound.apply({"params": whole}, *a, **k)

        dtype_tree = dtypes if dtypes is not None else jax.tree_util.tree_map(lambda p: p.dtype, shares)
        whole_like = jax.tree_util.tree_map(lambda p, d: jax.ShapeDtypeStruct(p.shape, d), shares, dtype_tree)
        from_weights, from_inputs, out_tree = _unzip(apply, whole_like, arrays)

        specs = jax.tree_util.tree_map(lambda sharding: sharding.spec, self.shardings[path])

        def cast_local(shares_local, source_local):
            zero = source_local.reshape(-1)[0].astype(jnp.float32) * 0.0
            return jax.tree_util.tree_map(lambda share, dtype: _tied(share, zero).astype(dtype), shares_local, dtype_tree)

        whole = jax.tree_util.tree_map(lambda _: NamedSharding(self.mesh, PartitionSpec()), specs)

        def prepared(shares_now, tie_source=None):
            """What the layer reads of its weights: the shares cast (each device its own; tied to its own part
            of `tie_source`, where given: no collective), gathered whole, and what the layer computes from
            them alone."""
            if tie_source is None:
                cast = jax.tree_util.tree_map(lambda share, dtype: share.astype(dtype), shares_now, dtype_tree)
                cast = jax.lax.with_sharding_constraint(cast, self.shardings[path])
            else:
                tied = shard_map()(cast_local, mesh=self.mesh, in_specs=(specs, self._split_of(tie_source)), out_specs=specs)
                cast = tied(shares_now, tie_source)
            gathered = jax.lax.with_sharding_constraint(cast, whole)
            return from_weights(*jax.tree_util.tree_leaves(gathered))

        slots = {}  # set while the forward traces: where the prepared weights sit among the pullback's residuals

        @jax.custom_vjp
        def layer(shares_now, arrays_now):
            return from_inputs(*prepared(shares_now, arrays_now[0]), *arrays_now)

        def forward(shares_now, arrays_now):
            weights = prepared(shares_now, arrays_now[0])  # not gathered before the layer's input exists
            outs, pullback = jax.vjp(lambda w, a: from_inputs(*w, *a), weights, arrays_now)
            leaves, slots["tree"] = jax.tree_util.tree_flatten(pullback)
            position = {id(w): i for i, w in enumerate(weights)}
            slots["where"] = [position.get(id(leaf)) for leaf in leaves]
            kept = [None if where is not None else leaf for leaf, where in zip(leaves, slots["where"])]
            return outs, (shares_now, kept)

        def backward(residuals, cotangent):
            shares_now, kept = residuals
            # Gathered again; not tied to the gradient arriving (measured: that held more of the step's buffers
            # at once, while XLA placed the untied gathers just before their layer anyway).
            weights, weights_pullback = jax.vjp(prepared, shares_now)
            leaves = [weights[where] if where is not None else leaf for leaf, where in zip(kept, slots["where"])]
            weight_grads, input_grads = jax.tree_util.tree_unflatten(slots["tree"], leaves)(cotangent)
            (share_grads,) = weights_pullback(weight_grads)
            return share_grads, input_grads

        layer.defvjp(forward, backward)
        return out_tree.unflatten(layer(shares, arrays))


def _tied(share, zero):
    """`share` plus a zero computed from another value: the gather then waits for that value (XLA cannot fold
    x * 0 away for floats), and differs from the backward's untied gather of the same share, so XLA does not
    merge the two into one copy held across the step."""
    if not jnp.issubdtype(share.dtype, jnp.floating):
        return share
    return share + zero.astype(share.dtype)


def _unzip(apply: Callable, whole_like, arrays):
    """`apply(whole, arrays)` cut by data dependence into (a function of the weights alone, returning what the
    rest reads of them; a function of that and `arrays`, returning the outputs' leaves; the outputs' tree)."""
    from jax._src import core
    from jax._src.interpreters import partial_eval

    closed, out_shape = jax.make_jaxpr(apply, return_shape=True)(whole_like, arrays)
    weights = len(jax.tree_util.tree_leaves(whole_like))
    known, unknown, _, _ = partial_eval.partial_eval_jaxpr_nounits(closed, [False] * weights + [True] * len(arrays), instantiate=True)
    return core.jaxpr_as_fun(known), core.jaxpr_as_fun(unknown), jax.tree_util.tree_structure(out_shape)


def _split_static(tree):
    """(the array leaves of `tree`, a function putting them back among its other leaves)."""
    leaves, structure = jax.tree_util.tree_flatten(tree)
    is_array = [isinstance(leaf, jax.Array) or hasattr(leaf, "aval") for leaf in leaves]
    arrays = [leaf for leaf, a in zip(leaves, is_array) if a]
    static = [None if a else leaf for leaf, a in zip(leaves, is_array)]

    def rebuild(new_arrays):
        it = iter(new_arrays)
        return structure.unflatten([next(it) if a else s for a, s in zip(is_array, static)])

    return arrays, rebuild


def by_module_path(dtypes_tree) -> Dict[Tuple[str, ...], Any]:
    """Module path -> its subtree, for every module of a params-shaped tree (nested dicts)."""
    found: Dict[Tuple[str, ...], Any] = {}

    def walk(node, path):
        if isinstance(node, dict) or hasattr(node, "items"):
            found[path] = node
            for key, value in node.items():
                walk(value, path + (key,))

    walk(dtypes_tree, ())
    return found
