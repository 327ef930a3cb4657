"""Sharding as data: per strategy, the mesh axes and the logical-axis -> mesh-axis rules.

The mesh always has two named axes, ("data", "model"). Rules are tried in order; a mesh axis is
used at most once per array (flax's logical_to_mesh semantics), so order picks which dimension
of a parameter a strategy splits.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from alpa_job.errors import KitError
from alpa_job.models.axes import BATCH, CHANNELS, CONV_IN, EMBED, HEADS, KV, MLP, SEQ, VOCAB

MESH_AXES = ("data", "model")

LogicalRules = List[Tuple[str, str]]

STRATEGY_RULES: Dict[str, LogicalRules] = {
    # Parameters whole in the step; only the batch is split (between steps the sharded update splits the
    # parameters too: UPDATE_SPLIT_LIKE).
    "data": [(BATCH, "data")],
    # ZeRO-3 / FSDP: every parameter (and so its optimizer state) split over the data axis too.
    # channels before conv_in: a stem conv has 3 input channels, which no device count divides.
    "fsdp": [(BATCH, "data"), (EMBED, "data"), (MLP, "data"), (CHANNELS, "data"), (VOCAB, "data"),
             (HEADS, "data"), (KV, "data"), (CONV_IN, "data"), (SEQ, "data")],
    # Megatron: feed-forward inner dim, attention heads, conv channels and vocab over "model".
    "tensor": [(BATCH, "data"), (MLP, "model"), (HEADS, "model"), (CHANNELS, "model"), (VOCAB, "model")],
}


# Weight-update sharding (Xu et al., "Automatic Cross-Replica Sharding of Weight Update in
# Data-Parallel Training"; Megatron-LM's distributed optimizer): under `data` with --data-update sharded,
# the fp32 parameters and the optimizer state stay split between steps as FSDP splits them. Each step
# begins by gathering the parameters whole, in the dtype the model reads them in (bf16 where it computes
# in bf16), runs the whole forward and backward on every device as plain data parallelism does, and
# reduce-scatters the gradients; each device updates only its share. Against one all-reduce of the
# gradients: the same bytes where nothing narrows, half the gather's where the model computes in bf16,
# the gather beside the forward's matmuls instead of after the last one, and half the update's state on
# two devices. Unlike FSDP, the backward never gathers again: the whole weights stay for it.
UPDATE_SPLIT_LIKE: Dict[str, str] = {"data": "fsdp"}


def update_split_like(strategy: str, data_update: str) -> Optional[str]:
    """The strategy whose split the parameters, the optimizer state and the gradients take between steps,
    where it differs from the forward's (None: the state stays as `strategy` splits it)."""
    return UPDATE_SPLIT_LIKE.get(strategy) if data_update == "sharded" else None


# Activations (named by models with api.constrain): rows always over "data", and under `tensor`
# the MLP's and attention's inner widths over "model" (Megatron: one all-reduce after each half of
# a block). The sequence stays whole between blocks: splitting it there too (sequence parallelism)
# turns each all-reduce into a reduce-scatter and an all-gather of the same bytes, which XLA could
# not hide behind the matmuls either, and it measured slower on two GPUs. No strategy splits an
# activation's model width: under `fsdp` that is what makes XLA gather each layer's parameters
# rather than reshard the activations to match the split parameters.
ACTIVATION_RULES: Dict[str, LogicalRules] = {
    "data": [(BATCH, "data")],
    "fsdp": [(BATCH, "data")],
    "tensor": [(BATCH, "data"), (MLP, "model"), (HEADS, "model"), (VOCAB, "model")],
}


# Strategies that split a parameter's first (outermost) dimension among those their rules name,
# rather than the one named by the earliest rule: FSDP gathers every parameter before its use and
# reduce-scatters its gradient after, and along the outermost dimension both are contiguous copies;
# along an inner one XLA transposes each parameter and gradient around the collective.
MAJOR_DIMENSION_FIRST = frozenset({"fsdp"})


def batch_mesh_axis(rules: LogicalRules) -> str:
    """The mesh axis a strategy splits the batch's rows over: its rule for the logical `batch` axis."""
    axis = next((mesh_axis for logical_name, mesh_axis in rules if logical_name == BATCH), None)
    if axis is None:
        raise KitError(f"a sharding rule list without a ({BATCH!r}, mesh axis) rule cannot split the batch; "
                       f"add one, e.g. ({BATCH!r}, {MESH_AXES[0]!r})")
    return axis


def mesh_shape_for(strategy: str, num_devices: int, model_parallel: int = 0,
                   devices_per_process: Optional[int] = None) -> Tuple[int, int]:
    """(data, model) sizes. `tensor` defaults to the largest model size <= 4 that divides one process's
    devices (`devices_per_process`, default all): each process reads only its own rows of the batch, so
    the model axis must not span processes (and inside one node it runs over the fastest links)."""
    if strategy != "tensor":
        return (num_devices, 1)
    if model_parallel == 0:
        per_process = devices_per_process or num_devices
        model_parallel = max(m for m in (1, 2, 3, 4) if num_devices % m == 0 and per_process % m == 0)
    if num_devices % model_parallel != 0:
        raise KitError(f"--model-parallel {model_parallel} does not divide the {num_devices} devices; "
                       f"use one of: {', '.join(str(d) for d in divisors(num_devices))}")
    return (num_devices // model_parallel, model_parallel)


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def auto_candidates(num_devices: int, devices_per_process: Optional[int] = None) -> List[Tuple[str, Tuple[int, int]]]:
    """Every strategy x mesh shape the `auto` search (and the planner) tries: tensor's model axis only
    inside one process's devices (`devices_per_process`, default all), as mesh_shape_for says why."""
    out = [("data", (num_devices, 1)), ("fsdp", (num_devices, 1))]
    out += [("tensor", (num_devices // m, m)) for m in divisors(devices_per_process or num_devices) if m > 1]
    return out
