"""An experiment for `--strategy data`: fp32 master weights split between steps, bf16 compute weights gathered.

The kit's sharded update (`--data-update sharded`) reduce-scatters the gradients, updates each device's
share of the fp32 parameters, and all-gathers the updated fp32 parameters at the end of every step: twice
the bytes the next step computes with, since the model casts each weight to bf16 before using it. Here,
as in Megatron-LM's distributed optimizer:
- the state holds the fp32 parameters split as fsdp splits them (beside Adam's split moments), and a
  `compute` copy, whole on every device, in the dtype the model reads each parameter in;
- the step computes with that copy, reduce-scatters its gradients, updates the split fp32 parameters,
  and all-gathers their cast: bf16 for every weight the model only ever reads as bf16.
A parameter the model also reads in fp32 (an embedding lookup) keeps an fp32 copy, so the losses are the
kit's sharded update's. Memory is about the same: half the fp32 parameters plus a whole bf16 copy.

Not in the kit: its benefit on GPUs is unmeasured. To measure it (a GPU machine), or to see the H100
schedule without one:

    python3 bench/gpu_multi.py --runs data bf16gather=data+bf16-gather
    python3 bench/gpu_schedule.py --variant bf16-gather
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from alpa_job.engines import jax_engine
from alpa_job.engines.sharding_rules import update_split_like

# Higher-order primitives whose inner jaxpr receives the outer operands in order: a parameter's reads
# are followed into them. Any other primitive that reads a parameter counts as a full-precision read.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr"}


def _read_only_as(jaxpr, var, dtype) -> bool:
    """Whether every read of `var` in `jaxpr` (and the calls it makes) is a cast to `dtype`."""
    if any(out is var for out in jaxpr.outvars):
        return False
    for eqn in jaxpr.eqns:
        for position, operand in enumerate(eqn.invars):
            if operand is not var:
                continue
            name = eqn.primitive.name
            if name == "convert_element_type" and eqn.params["new_dtype"] == dtype:
                continue
            if name in _CALLS and _CALLS[name] in eqn.params:
                inner = eqn.params[_CALLS[name]]
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr or a Jaxpr
                if _read_only_as(inner, inner.invars[position], dtype):
                    continue
            return False
    return True


def leaves_read_as(model, params, example_batch, dtype) -> Any:
    """A tree like `params`: True where the model's loss reads that parameter only as `dtype`."""
    closed = jax.make_jaxpr(lambda p, b: model.masked_loss(p, None, b))(params, example_batch)
    leaves, tree = jax.tree_util.tree_flatten(params)
    invars = closed.jaxpr.invars[:len(leaves)]
    return tree.unflatten([_read_only_as(closed.jaxpr, v, dtype) for v in invars])


class ComputeCopyState(jax_engine.TrainState):
    compute: Any = None  # the parameters as the model reads them, whole on every device


def _cast(leaf, dtype):
    if isinstance(leaf, nn.meta.AxisMetadata):  # a boxed parameter: the box keeps its logical axes
        return leaf.replace_boxed(leaf.unbox(apply_constraint=False).astype(dtype))
    return leaf.astype(dtype)


class _SplitMasterEngine(jax_engine.JaxEngine):
    """The kit's JaxEngine with the fp32 weights split between steps as the update splits them."""

    def __init__(self, config, model, example_batch, strategy, mesh_shape, schedule_steps=None):
        # The split the fp32 weights take between steps: the update's (None: the kit's own step). BatchNorm
        # models are left to the kit: their loss cannot be traced without batch statistics.
        self._master_split_like = None if model.has_batch_stats else update_split_like(strategy, config.data_update)
        super().__init__(config, model, example_batch, strategy, mesh_shape, schedule_steps)

    def _state_sharding(self, strategy, config, unboxed):
        sharding = super()._state_sharding(strategy, config, unboxed)
        if self._master_split_like is None:
            return sharding
        return sharding.replace(params=self._split_as(self._master_split_like, self.logical_specs.params,
                                                      unboxed.params))


class Bf16GatherEngine(_SplitMasterEngine):
    """For `data` with the sharded update, the state and step described above."""

    def __init__(self, config, model, example_batch, strategy, mesh_shape, schedule_steps=None):
        self._compute_dtypes = None  # from the first parameters _make_state sees
        super().__init__(config, model, example_batch, strategy, mesh_shape, schedule_steps)

    def _read_dtypes(self, params):
        """Each parameter's dtype as the model reads it: the compute dtype where every read is a cast to it."""
        values = jax.tree_util.tree_map(lambda x: x.unbox(apply_constraint=False) if isinstance(
            x, nn.meta.AxisMetadata) else x, params,
                                        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), values)
        compute = jnp.dtype(self.config.dtype)
        reads = leaves_read_as(self.model, shapes, self._example, compute)
        return jax.tree_util.tree_map(lambda p, low: compute if low else p.dtype, shapes, reads)

    def _make_state(self, params, batch_stats):
        state = super()._make_state(params, batch_stats)
        if self._master_split_like is None:
            return state
        if self._compute_dtypes is None:
            self._compute_dtypes = self._read_dtypes(params)
        compute = jax.tree_util.tree_map(_cast, params, self._compute_dtypes,
                                         is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
        return ComputeCopyState(**{f: getattr(state, f) for f in state.__dataclass_fields__}, compute=compute)

    def _train_step(self, state, batch):
        if self._master_split_like is None:
            return super()._train_step(state, batch)
        model = self.model

        def loss_fn(compute):
            return model.masked_loss(compute, state.batch_stats, batch)

        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.compute)
        grads = jax.lax.with_sharding_constraint(grads, self._gradient_sharding)  # reduce-scattered
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, state.params)
        state = state.apply_gradients(grads=grads)
        compute = jax.tree_util.tree_map(lambda p, c: p.astype(c.dtype), state.params, state.compute)
        return state.replace(compute=jax.lax.with_sharding_constraint(compute, self.state_sharding.compute)), loss


class Bf16GatherAtStartEngine(_SplitMasterEngine):
    """The same split fp32 weights, but no compute copy in the state: each step begins by gathering the
    cast of the split weights (bf16 where the model reads only bf16), where the forward's matmuls can hide
    it, as fsdp's gathers hide, instead of ending with it after the last matmul."""

    def __init__(self, config, model, example_batch, strategy, mesh_shape, schedule_steps=None):
        super().__init__(config, model, example_batch, strategy, mesh_shape, schedule_steps)
        if self._master_split_like is not None:
            params = self.abstract_state.params
            reads = leaves_read_as(self.model, params, self._example, jnp.dtype(self.config.dtype))
            compute = jnp.dtype(self.config.dtype)
            self._compute_dtypes = jax.tree_util.tree_map(lambda p, low: compute if low else p.dtype, params, reads)
            whole = NamedSharding(self.mesh, PartitionSpec())
            self._whole = jax.tree_util.tree_map(lambda _: whole, params)

    def _train_step(self, state, batch):
        if self._master_split_like is None:
            return super()._train_step(state, batch)
        model = self.model
        compute = jax.tree_util.tree_map(lambda p, d: p.astype(d), state.params, self._compute_dtypes)
        # The cast happens on each device's share, before the gather: XLA would otherwise gather the fp32
        # weights and fuse the cast into the matmuls that read them (twice the bytes).
        compute = jax.lax.optimization_barrier(compute)
        compute = jax.lax.with_sharding_constraint(compute, self._whole)  # the step's one all-gather

        def loss_fn(weights):
            return model.masked_loss(weights, state.batch_stats, batch)

        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(compute)
        grads = jax.lax.with_sharding_constraint(grads, self._gradient_sharding)  # reduce-scattered
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, state.params)
        return state.apply_gradients(grads=grads), loss


def install() -> None:
    """The CLI (and anything that builds JaxEngine through its module) builds this engine instead:
    the gather-at-start one when BF16_GATHER_AT=start."""
    at_start = os.environ.get("BF16_GATHER_AT") == "start"
    jax_engine.JaxEngine = Bf16GatherAtStartEngine if at_start else Bf16GatherEngine


if __name__ == "__main__":  # python3 bench/data_bf16_gather.py train ... : the kit's CLI with this engine
    install()
    sys.argv = ["alpa_job"] + sys.argv[1:]
    runpy.run_module("alpa_job", run_name="__main__")
