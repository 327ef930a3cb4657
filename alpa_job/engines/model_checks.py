"""Checks of a model against the step it is about to be compiled into, on abstract shapes only (no
device memory, no compile): the mistakes of a model a user brings become one-line errors before
training starts, instead of an XLA error or a silently replicated model.

- the batch field the model reads exists;
- its loss gives one value per example (a scalar or a per-token loss would be averaged wrongly);
- under `fsdp` / `tensor`, every weight matrix carries logical axes (otherwise those strategies
  leave it whole on every device without a word).
"""
from __future__ import annotations

from typing import Any, Dict

import jax
from jax.sharding import PartitionSpec

from alpa_job import strategies
from alpa_job.errors import KitError
from alpa_job.models import is_built_in


def check_batch_field(model, example: Dict[str, Any]) -> None:
    if model.input_key not in example:
        fields = ", ".join(k for k in example if k != "mask")
        raise KitError(f"--model {model.name} reads the batch field {model.input_key!r}, and the data gives: {fields}; "
                       "set its api.Model input_field to one of them (or make its synthetic data give it)")


def check_loss_shape(model, abstract_state, example: Dict[str, Any]) -> None:
    """The per-example loss has shape [batch rows], traced on abstract values (jax.eval_shape)."""
    variables = {"params": abstract_state.params}
    if model.has_batch_stats:
        variables["batch_stats"] = abstract_state.batch_stats

    def per_example(variables, batch):
        outputs, _ = model.apply_train(variables, batch)
        return model.loss(outputs, batch)

    out = jax.eval_shape(per_example, variables, example)
    rows = example["mask"].shape[0]
    shape = getattr(out, "shape", None)
    if shape is None or tuple(shape) != (rows,):
        got = f"shape {tuple(shape)}" if shape is not None else f"a {type(out).__name__}"
        raise KitError(f"--model {model.name}: its loss returns {got} for a batch of {rows} rows; return one loss "
                       f"per example, shape ({rows},) (average the other axes, e.g. .mean(axis=-1)); the kit "
                       "averages over the real rows itself")


def check_logical_axes(model_name: str, strategy: str, logical_params, abstract_params) -> None:
    """Under fsdp/tensor, the first weight (2 or more dimensions) that names no logical axis is an error."""
    if not strategies.get(strategy).splits_parameters:
        return
    is_spec = lambda x: isinstance(x, PartitionSpec) or x is None  # noqa: E731 - None: a leaf with no names
    specs = jax.tree_util.tree_leaves(logical_params, is_leaf=is_spec)
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
    for spec, (path, leaf) in zip(specs, leaves):
        if len(leaf.shape) >= 2 and not any(name is not None for name in (spec if isinstance(spec, PartitionSpec) else ())):
            name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
            raise KitError(f"--strategy {strategy} splits parameters by their logical axes, and --model {model_name}'s "
                           f"parameter {name} (shape {tuple(leaf.shape)}) carries none; wrap its initializer with "
                           "alpa_job.api.logical(init, (api.EMBED, api.MLP)) (one name per dimension) or use "
                           "--strategy data")


def check_against_step(model, strategy: str, logical_params, abstract_state, example: Dict[str, Any]) -> None:
    """Every model, against the strategy (fsdp/tensor need logical axes); a model the user brings, against
    the step: its loss's shape (one trace of the forward pass, on abstract values)."""
    check_logical_axes(model.name, strategy, logical_params, abstract_state.params)
    if strategies.get(strategy).pipelined:
        from alpa_job.engines.pipeline import check_pipelinable

        check_pipelinable(model)
    if not is_built_in(model.name):
        check_loss_shape(model, abstract_state, example)


def check_model(model, example: Dict[str, Any], strategy: str) -> None:
    """The checks the engine makes when it builds, for a caller with no engine (the driver before Ray):
    the variables' shapes and logical axes from the model's init alone (no optimizer, mesh or shardings)."""
    from types import SimpleNamespace

    import flax.linen as nn

    from alpa_job.engines.state_init import StateInitializer

    example = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in example.items()}
    check_batch_field(model, example)
    variables = lambda params, batch_stats: {"params": params, "batch_stats": batch_stats}  # noqa: E731
    boxed = StateInitializer(model, example, variables).abstract_boxed()
    check_against_step(model, strategy, nn.get_partition_spec(boxed)["params"],
                       SimpleNamespace(**nn.meta.unbox(boxed)), example)
