"""One record per JAX strategy: everything the kit knows about `--strategy NAME` in one place.

A `Strategy` holds its mesh axes' use, how it splits parameters and activations (logical axis -> mesh
axis rules: data, not code), how the update is split between steps, the XLA options its step compiles
with, how its mesh is shaped for N devices, and what the driver's and the engine's checks need to know.
Every reader (the engine, settings' validation, memory advice, the planner, auto's search, the failure
policy) takes these records; a new strategy is a new record, not new branches.

Plain Python (no jax): the settings' checks run before jax is imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from alpa_job.api import BATCH, CHANNELS, CONV_IN, EMBED, HEADS, KV, MLP, SEQ, VOCAB
from alpa_job.errors import KitError

MESH_AXES = ("data", "model")  # a strategy's two named mesh axes unless its record names others; sizes may be 1

MeshAxes = Union[str, Tuple[str, ...]]  # one mesh axis, or several a dimension is split over together
LogicalRules = List[Tuple[str, MeshAxes]]
LAYERS = "layers"  # the logical axis the kit adds in front of a pipeline's stacked blocks
REPEATS = "repeats"  # a circular pipeline's time round, in front of `layers`: never split (every stage has each)


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """What `--strategy name` means. Rules are tried in order; a mesh axis is used at most once per array
    (flax's logical_to_mesh semantics), so order picks which dimension of a parameter a strategy splits."""

    name: str
    summary: str  # one line: what it does (help texts, memory advice)
    param_rules: LogicalRules  # parameters (and so their optimizer state)
    activation_rules: LogicalRules  # activations a model names with api.constrain
    # Split a parameter's outermost dimension among those the rules name, rather than the earliest rule's:
    # for strategies that gather every parameter before use (contiguous copies along the outermost one).
    major_dimension_first: bool = False
    # Weight-update sharding: under --data-update sharded, the strategy whose split the parameters, the
    # optimizer state and the gradients take between steps (None: as this one splits them).
    update_split_like: Optional[str] = None
    compiler_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # jax.jit(compiler_options=)
    # Its parameters are split by their logical axes: a large parameter without names is refused.
    splits_parameters: bool = False
    # Has a "model" mesh axis, kept inside one process's devices (each process reads only its own batch rows).
    model_axis: bool = False
    # Two-level: its second mesh axis is exactly one host's devices (one process per host), its first runs
    # across hosts, so what the second axis sends stays on the host's fast links.
    host_level: bool = False
    # Pipeline stages: its first mesh axis holds stages of the model's repeated blocks (engines/pipeline.py),
    # one per host by default, so what crosses hosts is the activations between stages.
    pipelined: bool = False
    mesh_axes: Tuple[str, str] = MESH_AXES
    # Gathers every split parameter whole before use (fsdp's way), so each layer can gather its own just in
    # time and free it after (--fsdp-gather layer).
    gathers_layers: bool = False
    # Offered to a user whose state does not fit another strategy (memory advice): why it helps.
    memory_relief: Optional[str] = None

    def mesh_shape(
        self, num_devices: int, model_parallel: int = 0, devices_per_process: Optional[int] = None, stages: int = 0
    ) -> Tuple[int, int]:
        """(data, model) sizes on `num_devices` devices, `devices_per_process` each (default: all in one).
        A model axis defaults to the largest size <= 4 that divides one process's devices: it must not span
        processes, and inside one node it runs over the fastest links. A pipeline's `stages` default to
        one per host (two on one host)."""
        if self.pipelined:
            count = pipeline_stages(num_devices, devices_per_process, stages)
            return (count, num_devices // count)
        if self.host_level:
            per_host = devices_per_process or num_devices
            if num_devices % per_host:
                raise KitError(
                    f"--strategy {self.name} needs the same number of devices on every host: "
                    f"{num_devices} devices do not split into hosts of {per_host}; "
                    f"use --strategy fsdp or equal hosts"
                )
            return (num_devices // per_host, per_host)
        if not self.model_axis:
            return (num_devices, 1)
        if model_parallel == 0:
            per_process = devices_per_process or num_devices
            model_parallel = max(m for m in (1, 2, 3, 4) if num_devices % m == 0 and per_process % m == 0)
        if num_devices % model_parallel != 0:
            raise KitError(
                f"--model-parallel {model_parallel} does not divide the {num_devices} devices; "
                f"use one of: {', '.join(str(d) for d in divisors(num_devices))}"
            )
        return (num_devices // model_parallel, model_parallel)

    def candidate_meshes(self, num_devices: int, devices_per_process: Optional[int] = None) -> List[Tuple[int, int]]:
        """Every mesh `auto` and the planner try: a model axis only inside one process's devices; a two-level
        mesh only where it differs from a flat one (several hosts of several devices each); pipeline stages
        only across several hosts."""
        per_host = devices_per_process or num_devices
        several_hosts = per_host < num_devices and num_devices % per_host == 0
        if self.pipelined:
            # One stage a host, where stages pay off: on one host every strategy has the fast links, and a
            # pipeline only adds its bubble.
            return [self.mesh_shape(num_devices, 0, per_host)] if several_hosts else []
        if self.host_level:
            return [self.mesh_shape(num_devices, 0, per_host)] if several_hosts and per_host > 1 else []
        if not self.model_axis:
            return [(num_devices, 1)]
        return [(num_devices // m, m) for m in divisors(devices_per_process or num_devices) if m > 1]

    def batch_ways(self, mesh_shape: Tuple[int, int]) -> int:
        """How many ways the batch's rows are split on `mesh_shape`: the size of its batch mesh axes."""
        sizes = dict(zip(self.mesh_axes, mesh_shape))
        ways = 1
        for axis in axes_of(batch_mesh_axis(self.param_rules)):
            ways *= sizes[axis]
        return ways

    def update_split(self, data_update: str) -> Optional[str]:
        """The strategy whose split the state takes between steps, where it differs from the forward's."""
        return self.update_split_like if data_update == "sharded" else None


# XLA combines FSDP-style gathers and reduce-scatters only up to a size threshold, by default well under
# one GPT layer's weights, so each layer costs several NCCL calls, each taking SMs from the matmuls beside
# it. Combining several layers' collectives (JAX-Toolbox recommends thresholds of at least a layer's
# weights) keeps the bytes and cuts the calls. All-reduces (data's replicated update) measured no faster
# with larger thresholds: these options leave them alone.
_COMBINE_BYTES = 512 * 2**20  # several GPT-24L layers' bf16 weights (about 100 MB each) per collective
COMBINED_GATHERS = {
    "xla_gpu_all_gather_combine_threshold_bytes": _COMBINE_BYTES,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": _COMBINE_BYTES,
}

DATA = Strategy(
    name="data",
    summary="whole parameters in the step, the batch split over every device",
    param_rules=[(BATCH, "data")],
    activation_rules=[(BATCH, "data")],
    # Weight-update sharding (Xu et al.; Megatron-LM's distributed optimizer): the fp32 parameters and the
    # optimizer state stay split between steps as fsdp splits them. Each step begins by gathering the
    # parameters whole, in the dtype the model reads them in, runs the whole forward and backward on every
    # device, and reduce-scatters the gradients; each device updates its share. Unlike fsdp, the backward
    # never gathers again.
    update_split_like="fsdp",
    compiler_options=COMBINED_GATHERS,  # its sharded update gathers and reduce-scatters as fsdp does
)


def fsdp_rules(axis: str) -> LogicalRules:
    """fsdp's parameter rules on `axis`: every named dimension it may split (the outermost that divides, with
    major_dimension_first). Channels before conv_in: a stem conv has 3 input channels, which no device
    count divides."""
    return [(name, axis) for name in (EMBED, MLP, CHANNELS, VOCAB, HEADS, KV, CONV_IN, SEQ)]


FSDP = Strategy(
    name="fsdp",
    summary="ZeRO-3 / FSDP: every parameter and its optimizer state split over the devices",
    param_rules=[(BATCH, "data"), *fsdp_rules("data")],
    # No activation's model width is split: that is what makes XLA gather each layer's parameters rather
    # than reshard the activations to match the split parameters.
    activation_rules=[(BATCH, "data")],
    major_dimension_first=True,
    compiler_options=COMBINED_GATHERS,
    splits_parameters=True,
    gathers_layers=True,
    memory_relief="shards the state over the devices",
)

TENSOR = Strategy(
    name="tensor",
    summary="Megatron: feed-forward inner width, attention heads, conv channels and vocab over a model axis",
    param_rules=[(BATCH, "data"), (MLP, "model"), (HEADS, "model"), (CHANNELS, "model"), (VOCAB, "model")],
    # The MLP's and attention's inner widths over "model" (one all-reduce after each half of a block). The
    # sequence stays whole between blocks: splitting it too (sequence parallelism) turns each all-reduce
    # into a reduce-scatter and an all-gather of the same bytes that XLA could not hide either; slower.
    activation_rules=[(BATCH, "data"), (MLP, "model"), (HEADS, "model"), (VOCAB, "model")],
    splits_parameters=True,
    model_axis=True,
    memory_relief="splits the layers over a model axis",
)

HSDP = Strategy(
    name="hsdp",
    summary="hybrid sharded data parallel: fsdp among one host's devices, data parallel across hosts",
    # FSDP's rules on the within-host axis: its gathers and reduce-scatters (every layer, twice a step) run
    # over a host's fast links; across hosts only the gradients' all-reduce, once a step, as data's.
    param_rules=[(BATCH, ("data", "fsdp")), *fsdp_rules("fsdp")],
    activation_rules=[(BATCH, ("data", "fsdp"))],
    major_dimension_first=True,
    compiler_options=COMBINED_GATHERS,
    splits_parameters=True,
    gathers_layers=True,
    host_level=True,
    mesh_axes=("data", "fsdp"),
    # No memory advice: it shards over one host's devices, never more than fsdp does, and on one host it is
    # fsdp; suggesting both would be noise.
)

PIPELINE = Strategy(
    name="pipeline",
    summary="GPipe stages of the repeated blocks over a stage axis (one per host), data parallel within a stage",
    # The stacked blocks' `layers` dimension over the stages; the shell (embeddings, head) whole everywhere.
    param_rules=[(BATCH, ("stage", "data")), (LAYERS, "stage")],
    activation_rules=[],  # the step runs under shard_map: every device's layout is explicit there
    pipelined=True,
    mesh_axes=("stage", "data"),
)

PIPELINE_FSDP = Strategy(
    name="pipeline-fsdp",
    summary="pipeline stages as pipeline, each stage's parameters and optimizer state split over its devices (fsdp within a stage)",
    # The stacked blocks' `layers` dimension over the stages, then fsdp's rules over the devices of a stage:
    # a stage's devices (one host by default) gather its parameters once a step over the host's fast links.
    param_rules=[(BATCH, ("stage", "data")), (LAYERS, "stage"), *fsdp_rules("data")],
    activation_rules=[],
    major_dimension_first=True,
    splits_parameters=True,
    pipelined=True,
    mesh_axes=("stage", "data"),
)

STRATEGIES: Dict[str, Strategy] = {s.name: s for s in (DATA, FSDP, TENSOR, HSDP, PIPELINE, PIPELINE_FSDP)}
AUTO = "auto"  # not a record: the search over every record's candidate meshes


def pipeline_stages(num_devices: int, devices_per_process: Optional[int] = None, stages: int = 0) -> int:
    """The stage count: as asked, or one per host (two on one host); one line where it leaves devices idle
    or splits a host between stages that are not all on it."""
    hosts = num_devices // (devices_per_process or num_devices)
    chosen = stages or (hosts if hosts > 1 else 2)
    if num_devices % chosen:
        raise KitError(
            f"--pipeline-stages {chosen} does not divide the {num_devices} devices (it would leave some "
            f"idle); use one of: {', '.join(str(d) for d in divisors(num_devices) if d > 1)}"
        )
    if hosts > 1 and chosen % hosts and hosts % chosen:
        raise KitError(
            f"--pipeline-stages {chosen} on {hosts} hosts would put one stage on parts of two hosts; use "
            f"a multiple or a divisor of {hosts} (default: one stage per host)"
        )
    return chosen


def micro_batches(asked: int, stages: int) -> int:
    """A pipeline's micro-batches: as asked (--micro-batches), or 4 a stage (GPipe's bubble, (S - 1) / (M + S - 1),
    then stays under a fifth)."""
    return asked or 4 * stages


def check_micro_batches(batch_size: int, mesh_shape: Tuple[int, int], micro: int, where: str = "") -> None:
    """A pipeline cuts each data-parallel slot's rows into `micro` micro-batches: the batch must split into
    both. One line naming batch sizes that do (the driver before Ray, and the engine for in-process callers)."""
    stages, data = mesh_shape
    step = data * micro
    if batch_size % step:
        near = sorted({max(step, batch_size // step * step), (batch_size // step + 1) * step})
        raise KitError(
            f"--batch-size {batch_size} does not split into {micro} micro-batches on each of the "
            f"pipeline's {data} data-parallel slot(s) ({stages} stages on {stages * data} devices); use a "
            f"multiple of {step} (--batch-size {' or '.join(map(str, near))}) or other --micro-batches{where}"
        )


def check_batch_split(batch_size: int, ways: int, advice: Optional[str] = None, where: str = "", when: str = "") -> None:
    """The one rule on a global batch and a mesh: its rows split evenly over the `ways` data-parallel slots
    (the driver before Ray, the engine, a restart on fewer nodes and the planner all apply it). `advice`:
    the fix in the caller's words (default: the multiples of `ways` next to the batch); `when`: what the
    caller was doing, said first."""
    if batch_size % ways:
        lower = batch_size // ways * ways
        near = " or ".join(str(b) for b in (lower, lower + ways) if b > 0)
        raise KitError(
            f"{when}batch size {batch_size} is not divisible by the data-parallel size {ways}; "
            f"{advice or f'use a multiple of {ways} (--batch-size {near})'}{where}"
        )


def get(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KitError(f"unknown JAX strategy {name!r}; use one of: {', '.join(STRATEGIES)}") from None


def auto_candidates(num_devices: int, devices_per_process: Optional[int] = None) -> List[Tuple[str, Tuple[int, int]]]:
    """Every strategy x mesh shape the `auto` search (and the planner) tries."""
    return [(s.name, mesh) for s in STRATEGIES.values() for mesh in s.candidate_meshes(num_devices, devices_per_process)]


def data_axis_size(name: str, num_devices: int, model_parallel: int = 0, devices_per_process: Optional[int] = None) -> int:
    """How many ways the batch is split: the mesh's data axis (auto: every candidate's divides the device
    count, so the whole count is the one to check)."""
    if name == AUTO:
        return num_devices
    record = get(name)
    return record.batch_ways(record.mesh_shape(num_devices, model_parallel, devices_per_process))


def axes_of(mesh_axes: MeshAxes) -> Tuple[str, ...]:
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def batch_mesh_axis(rules: LogicalRules) -> MeshAxes:
    """The mesh axis (or axes) a strategy splits the batch's rows over: its rule for the logical `batch` axis."""
    axis = next((mesh_axis for logical_name, mesh_axis in rules if logical_name == BATCH), None)
    if axis is None:
        raise KitError(
            f"a sharding rule list without a ({BATCH!r}, mesh axis) rule cannot split the batch; "
            f"add one, e.g. ({BATCH!r}, {MESH_AXES[0]!r})"
        )
    return axis
