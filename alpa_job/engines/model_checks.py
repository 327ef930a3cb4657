"""Checks of a model against the step it is about to be compiled into, on abstract shapes only (no
device memory, no compile): the mistakes of a model a user brings become one-line errors before
training starts, instead of an XLA error or a silently replicated model.

- the batch field the model reads exists;
- its loss gives one value per example (a scalar or a per-token loss would be averaged wrongly);
- under `fsdp` / `tensor`, every weight matrix larger than SMALL_UNNAMED_BYTES carries logical axes
  (otherwise those strategies would leave it whole on every device without a word); a smaller one without
  names (a bias of shape (3, 4, 32), a norm's scale) stays whole on every device, said in a note.
"""

from __future__ import annotations

from typing import Any, Dict, List

import jax
from jax.sharding import PartitionSpec

from alpa_job import strategies
from alpa_job.errors import KitError
from alpa_job.models import is_built_in
from alpa_job.units import human_bytes

# Below this, a parameter with no logical axis names is replicated under fsdp/tensor: splitting it would
# save little memory and cost a collective; above it, the user is asked to name its axes.
SMALL_UNNAMED_BYTES = 1 << 20


def check_batch_field(model, example: Dict[str, Any]) -> None:
    if model.input_key not in example:
        fields = ", ".join(k for k in example if k != "mask")
        raise KitError(
            f"--model {model.name} reads the batch field {model.input_key!r}, and the data gives: {fields}; "
            "set its api.Model input_field to one of them (or make its synthetic data give it)"
        )


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
        raise KitError(
            f"--model {model.name}: its loss returns {got} for a batch of {rows} rows; return one loss "
            f"per example, shape ({rows},) (average the other axes, e.g. .mean(axis=-1)); the kit "
            "averages over the real rows itself"
        )


def check_logical_axes(model_name: str, strategy: str, logical_params, abstract_params) -> List[str]:
    """Under fsdp/tensor: the first weight (2 or more dimensions, SMALL_UNNAMED_BYTES or more) that names no
    logical axis is an error; the smaller unnamed ones are kept whole on every device: one note for them."""
    if not strategies.get(strategy).splits_parameters:
        return []
    is_spec = lambda x: isinstance(x, PartitionSpec) or x is None  # noqa: E731 - None: a leaf with no names
    specs = jax.tree_util.tree_leaves(logical_params, is_leaf=is_spec)
    leaves = jax.tree_util.tree_leaves_with_path(abstract_params)
    kept_whole = []
    for spec, (path, leaf) in zip(specs, leaves):
        if len(leaf.shape) < 2 or any(name is not None for name in (spec if isinstance(spec, PartitionSpec) else ())):
            continue
        name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        size = leaf.size * leaf.dtype.itemsize
        if size < SMALL_UNNAMED_BYTES:
            kept_whole.append(f"{name} {tuple(leaf.shape)}")
            continue
        raise KitError(
            f"--strategy {strategy} splits parameters by their logical axes, and --model {model_name}'s "
            f"parameter {name} (shape {tuple(leaf.shape)}, {human_bytes(size)}) carries none; wrap its "
            "initializer with alpa_job.api.logical(init, (api.EMBED, api.MLP)) (one name per dimension) "
            f"or use --strategy data (parameters under {human_bytes(SMALL_UNNAMED_BYTES)} may go unnamed: "
            "they stay whole on every device)"
        )
    if not kept_whole:
        return []
    return [
        f"--strategy {strategy}: {len(kept_whole)} parameter(s) of --model {model_name} name no logical axes and "
        f"are under {human_bytes(SMALL_UNNAMED_BYTES)}, so every device keeps them whole: "
        + ", ".join(kept_whole[:5])
        + (", ..." if len(kept_whole) > 5 else "")
    ]


def check_against_step(model, strategy: str, logical_params, abstract_state, example: Dict[str, Any]) -> List[str]:
    """Every model, against the strategy (fsdp/tensor need logical axes); a model the user brings, against
    the step: its loss's shape (one trace of the forward pass, on abstract values). Returns the notes for
    the report (small unnamed parameters kept whole)."""
    notes = check_logical_axes(model.name, strategy, logical_params, abstract_state.params)
    if strategies.get(strategy).pipelined:
        from alpa_job.engines.pipeline import check_pipelinable

        check_pipelinable(model)
    if not is_built_in(model.name):
        check_loss_shape(model, abstract_state, example)
    return notes


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
    check_against_step(model, strategy, nn.get_partition_spec(boxed)["params"], SimpleNamespace(**nn.meta.unbox(boxed)), example)
