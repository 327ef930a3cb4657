"""The typed run record: what producers build and consumers read; report.json is its serialization.

Public names (stable): `ProcessResult` (what one JAX process -- or the Alpa driver -- returns),
`RunRecord` (the run: a ProcessResult of process 0 plus the run-level facts), and their rows:
`ProcessInfo`, `DeviceInfo`, `MeshShape`, `MeshRecord`, `Leaf`, `Collective`, `MemoryRecord`,
`StageRecord`, `SearchCandidate`, `RestartRecord`, `Summary`. `SCHEMA_VERSION` is written as `schema_version`.

Field names are the report.json keys users already read (`params`, `batch_sharding`, `losses`,
...), so a report written before schema_version existed still loads (`from_dict` fills defaults
and ignores keys it does not know); the shipped JSON Schema (report.schema.json) is strict and
catches drift in what the kit writes. Stdlib only, Python 3.9 (the Alpa image) and 3.11.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
from typing import Any, Dict, Iterable, List, Optional

from alpa_job.errors import KitError

SCHEMA_VERSION = 1
SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report.schema.json")

# Alpa writes *.mem_usage.txt as `bytes / 1024**3` with 3 decimals (GiB, printed "GB").
GIB = 1024**3


# ============================================================================ rows
@dataclasses.dataclass
class MeshShape:
    """The run's device mesh as the user asked for it (JAX: data x model; Alpa: node x gpu)."""

    shape: List[int] = dataclasses.field(default_factory=list)
    axes: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class MeshRecord:
    """One device mesh of the plan (Alpa pipeshard has one per stage)."""

    id: int
    shape: List[int]
    axes: List[str]
    batch_axes: List[str]
    devices: int


@dataclasses.dataclass
class Leaf:
    """One array of the train state (`params` rows) or of the batch (`batch_sharding` rows)."""

    path: str
    shape: List[int]
    dtype: str
    bytes: int
    bytes_per_device: int
    spec: str
    mesh_ids: List[int]
    split_axes: List[List[str]]  # per array dimension, the mesh axes that split it
    strategy: str  # DP | ZeRO | MP | MP+ZeRO | replicated (plan.STRATEGY_LABELS)


@dataclasses.dataclass
class Collective:
    """One collective kind in the optimized HLO: instances and result bytes summed."""

    count: int = 0
    bytes: int = 0

    @staticmethod
    def table(counts: Dict[str, Dict[str, int]]) -> Dict[str, "Collective"]:
        """{kind: Collective} from hlo.count_collectives' {kind: {"count", "bytes"}}."""
        return {kind: Collective(count=c["count"], bytes=c["bytes"]) for kind, c in counts.items()}


@dataclasses.dataclass
class MemoryRecord:
    """Device memory of the compiled step. Each producer fills what it can measure.

    JAX engine: XLA's memory analysis (per device). Alpa: the executable's allocation, in total
    and per pipeline stage (forward stages first, then backward: stage i and 2n-1-i share mesh i).
    """

    argument_size_in_bytes: Optional[int] = None
    output_size_in_bytes: Optional[int] = None
    temp_size_in_bytes: Optional[int] = None
    alias_size_in_bytes: Optional[int] = None
    generated_code_size_in_bytes: Optional[int] = None
    peak_estimate_bytes: Optional[int] = None
    total_allocation_bytes: Optional[int] = None
    stage_allocation_bytes: Optional[List[int]] = None

    @classmethod
    def from_xla(cls, analysis: Optional[Dict[str, int]]) -> Optional["MemoryRecord"]:
        """From jax_program.memory_analysis()'s dict (None stays None)."""
        return None if analysis is None else _decode_fields(cls, analysis)

    @classmethod
    def from_plain(cls, data: Dict[str, Any]) -> "MemoryRecord":
        """From report.json data; also reads the Alpa engine's older shapes:
        {"stage_0": bytes, ...} and {"total_allocation_size": bytes}."""
        stage_keys = sorted((k for k in data if k.startswith("stage_") and k[6:].isdigit()), key=lambda k: int(k[6:]))
        if stage_keys:
            return cls.from_stage_bytes([data[k] for k in stage_keys])
        if "total_allocation_size" in data:
            return cls.from_stage_bytes(total_bytes=data["total_allocation_size"])
        return _decode_fields(cls, data)

    @classmethod
    def from_stage_bytes(cls, stage_bytes: Optional[Iterable[int]] = None, total_bytes: Optional[int] = None) -> "MemoryRecord":
        stages = [int(b) for b in stage_bytes] if stage_bytes is not None else None
        if total_bytes is None and stages:
            total_bytes = sum(stages)
        return cls(total_allocation_bytes=None if total_bytes is None else int(total_bytes), stage_allocation_bytes=stages)


@dataclasses.dataclass
class StageRecord:
    """One pipeline stage (forward stage i with its backward twin, both on mesh i); a
    shard-parallel Alpa step is one stage on mesh 0."""

    stage: int
    mesh: Optional[int] = None
    layers: Optional[List[int]] = None  # model layers in this stage (auto stage search only)
    submesh_shape: Optional[List[int]] = None
    logical_shape: Optional[List[int]] = None
    autosharding_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    memory_bytes: Optional[int] = None  # all of this stage's executables on its mesh
    memory_bytes_forward: Optional[int] = None
    memory_bytes_backward: Optional[int] = None
    collectives: Optional[Dict[str, Collective]] = None  # from this stage's HLO (dump folders)


@dataclasses.dataclass
class ProcessInfo:
    id: int = 0
    count: int = 1
    host: Optional[str] = None
    ip: Optional[str] = None
    local_devices: List[str] = dataclasses.field(default_factory=list)
    coordinator: Optional[str] = None
    # This process's share of the input: each process reads only its own rows of every global batch.
    rows_read: Optional[int] = None
    bytes_read: Optional[int] = None
    # Preempted: the step this process stopped at (the run's stopped_at_step is process 0's; each one's own
    # shows that none trained past the agreed step).
    stopped_at_step: Optional[int] = None
    # GPUs of a multi-process run: the transports NCCL chose for this process, and what is wrong with them.
    nccl: Optional[Dict[str, Any]] = None
    # JAX: where this process's train step came from, "compiled" or "stored" (its own step store entry).
    step_source: Optional[str] = None


@dataclasses.dataclass
class DeviceInfo:
    count: Optional[int] = None
    platform: Optional[str] = None
    kind: Optional[str] = None


@dataclasses.dataclass
class RestartRecord:
    """One restart after a lost JAX process or node (`--max-restarts`)."""

    time: str  # when the loss was detected (ISO 8601, UTC, milliseconds)
    host: Optional[str]  # the lost process's host name
    ip: Optional[str]  # its node's IP
    node_id: Optional[str]  # its Ray node id
    process: int  # its process index
    reason: str  # first line of the error Ray gave
    failed_at_step: Optional[int]  # the last step the process reported
    resumed_from_step: int  # the checkpoint step the next attempt restored (0: none yet, started over)
    steps_lost: int  # steps run past that checkpoint, run again
    processes_after: int  # processes of the next attempt
    recover_seconds: Optional[float]  # detection -> the first step of the next attempt


@dataclasses.dataclass
class SearchCandidate:
    """One row of the JAX engine's `--strategy auto` table."""

    strategy: str
    mesh_shape: List[int]
    fits: Optional[bool] = None
    peak_bytes_per_device: Optional[int] = None
    compile_s: Optional[float] = None
    step_time_s: Optional[float] = None  # predicted for the whole model where predicted_from is set
    chosen: bool = False
    note: str = ""
    predicted_from: Optional[List[int]] = None  # the layer counts of the copies it was timed on
    copy_step_time_s: Optional[List[float]] = None  # those copies' measured step times
    whole_compile_s: Optional[float] = None  # the winner's compile at full depth


@dataclasses.dataclass
class Summary:
    """Numbers derived from the record (recomputed on load; never edited by hand)."""

    state_bytes: int = 0
    state_bytes_per_device: int = 0
    param_count: int = 0
    strategy_counts: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=dict)
    loss_first: Optional[float] = None
    loss_last: Optional[float] = None
    processes: int = 1
    hosts: int = 1
    devices: Optional[int] = None
    one_compile: bool = False


@dataclasses.dataclass
class InputRecord:
    """What the input pipeline did (this process's numbers; every process reads its own share)."""

    dataset: str = ""  # what was read, in words (files, rows)
    rows: int = 0  # rows in the dataset (token windows, records, samples)
    steps_per_epoch: int = 0
    epochs: float = 0.0  # passes over the dataset this run made (a resumed run counts from its start)
    rows_read: int = 0
    bytes_read: int = 0
    bytes_per_s: Optional[float] = None  # over the training loop
    data_wait_s: float = 0.0  # the loop waited this long, in all, for its next batch
    data_wait_per_step_s: Optional[float] = None
    data_wait_fraction: Optional[float] = None  # of the loop's time
    pipeline: str = ""  # grain (prefetch threads) or in-memory


@dataclasses.dataclass
class EvalPoint:
    """The eval split's masked mean loss at one step (--eval-every), perplexity for token data."""

    step: int
    loss: float
    perplexity: Optional[float] = None
    batches: int = 0


# ============================================================================ process and run
@dataclasses.dataclass
class ProcessResult:
    """What one JAX process returns from training (the Alpa driver returns one for the run).

    `final_state` is the trained TrainState for in-process callers; it is never serialized.
    """

    engine: str
    strategy: str
    requested_strategy: Optional[str] = None
    mesh: MeshShape = dataclasses.field(default_factory=MeshShape)
    meshes: List[MeshRecord] = dataclasses.field(default_factory=list)
    params: List[Leaf] = dataclasses.field(default_factory=list)
    batch_sharding: List[Leaf] = dataclasses.field(default_factory=list)
    compiles: Optional[int] = None
    backend_compiles_during_loop: Optional[int] = None
    compile_seconds: Optional[float] = None
    collectives: Optional[Dict[str, Collective]] = None
    memory: Optional[MemoryRecord] = None
    stages: List[StageRecord] = dataclasses.field(default_factory=list)
    search: Optional[List[SearchCandidate]] = None
    resumed_from_step: Optional[int] = None
    eval_loss: Optional[float] = None
    evals: List[EvalPoint] = dataclasses.field(default_factory=list)  # with --eval-data-path
    input: Optional[InputRecord] = None
    alpa_method: Optional[Dict[str, Any]] = None  # the Alpa method settings (strategy, micro batches, ...)
    plan_cache: Optional[Dict[str, Any]] = None  # Alpa pipeshard-auto plan cache decision
    compiler_options: Optional[Dict[str, Any]] = None  # XLA options the JAX step compiled with (xla_options)
    weight_gather: Optional[Dict[str, Any]] = None  # fsdp/hsdp: per layer or XLA's placement, and why
    # Per device per train step: bytes sent within its host and across hosts (record/traffic.py's summary).
    network_traffic: Optional[Dict[str, Any]] = None
    # The JAX engine's pipeline: stages, micro-batches, schedule, bubble fraction, blocks and processes a stage.
    pipeline: Optional[Dict[str, Any]] = None
    # A run over several processes or GPUs: an all-reduce over every device timed before the first step.
    network_measured: Optional[Dict[str, Any]] = None
    # A multi-process run: each process's own share timed every few steps, and who was slow (train/stragglers.py).
    stragglers: Optional[Dict[str, Any]] = None
    process: ProcessInfo = dataclasses.field(default_factory=ProcessInfo)
    devices: DeviceInfo = dataclasses.field(default_factory=DeviceInfo)
    versions: Dict[str, Optional[str]] = dataclasses.field(default_factory=dict)
    steps: int = 0
    samples_seen: int = 0
    samples_dropped: int = 0
    loop_seconds: Optional[float] = None
    step_time_s: Optional[float] = None
    throughput: Optional[float] = None
    losses: List[float] = dataclasses.field(default_factory=list)
    # Phases, steady-state step median/p10/p90, TFLOP/s, MFU, measured vs estimated peak memory (timing.py).
    timing: Optional[Dict[str, Any]] = None
    # Restarts after a lost process/node (run-level; set on process 0's result by the launch controller).
    # With restarts, steps/samples_seen count the final trajectory once (lost steps are not counted).
    restarts: List[RestartRecord] = dataclasses.field(default_factory=list)
    # Warnings the run printed that stay true of it (a --checkpoint-every that never saves), one line each.
    notes: List[str] = dataclasses.field(default_factory=list)
    # Preempted (SIGTERM): the global step every process stopped at, saved as a checkpoint there.
    stopped_at_step: Optional[int] = None
    final_state: Any = dataclasses.field(default=None, repr=False, compare=False)

    def to_dict(self) -> Dict[str, Any]:
        return _encode(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]):
        """From report.json-style data (unknown keys are ignored; missing ones take defaults)."""
        return _decode(cls, data)

    @classmethod
    def coerce(cls, value: Any) -> "ProcessResult":
        """A ProcessResult from a ProcessResult or the plain dict producers returned before it."""
        if isinstance(value, ProcessResult):
            return value
        result = _decode(ProcessResult, value)
        result.final_state = value.get("final_state")
        return result


@dataclasses.dataclass
class RunRecord(ProcessResult):
    """The run: process 0's result, every process's identity, the job config, the summary.

    Built by `RunRecord.from_processes` (training), `inspect.load` (Alpa dump folder, report.json)
    and the Alpa engine's live plan; rendered by inspect.render / inspect.plots.
    """

    schema_version: int = SCHEMA_VERSION
    processes: List[ProcessInfo] = dataclasses.field(default_factory=list)
    config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    created: Optional[str] = None
    address: Optional[str] = None
    source: Optional[str] = None  # the folder an Alpa dump was read from
    status: str = "ok"  # ok | failed | interrupted | diverged | preempted (a failed run still writes its report)
    error: Optional[str] = None  # why it stopped (one line), for failed/interrupted runs
    summary: Summary = dataclasses.field(default_factory=Summary)
    tensorboard: Optional[str] = None  # the run's TensorBoard event files (OUT/tensorboard); None: none written

    @classmethod
    def from_processes(cls, results: Iterable[Any], config: Optional[Dict[str, Any]] = None, **run_fields: Any) -> "RunRecord":
        """Merge per-process results (any order) into one record led by process 0."""
        typed = sorted((ProcessResult.coerce(r) for r in results), key=lambda r: r.process.id)
        if not typed:
            raise KitError("no process returned a result; see the worker logs above")
        lead = typed[0]
        values = {f.name: getattr(lead, f.name) for f in dataclasses.fields(ProcessResult)}
        values["final_state"] = None
        record = cls(**values, processes=[r.process for r in typed], config=dict(config or {}), **run_fields)
        record.summary = record.summarize()
        return record

    def summarize(self) -> Summary:
        counts: Dict[str, Dict[str, int]] = {"params": {}, "opt_state": {}}
        for row in self.params:
            group = row.path.split("/", 1)[0]
            if group in counts:
                counts[group][row.strategy] = counts[group].get(row.strategy, 0) + 1
        losses = self.losses
        return Summary(
            state_bytes=sum(r.bytes for r in self.params),
            state_bytes_per_device=sum(r.bytes_per_device for r in self.params),
            param_count=sum(_numel(r.shape) for r in self.params if r.path.startswith("params/")),
            strategy_counts=counts,
            loss_first=losses[0] if losses else None,
            loss_last=losses[-1] if losses else None,
            processes=len(self.processes) or 1,
            hosts=len({p.ip or p.host for p in self.processes}) or 1,
            devices=self.devices.count,
            one_compile=self.compiles == 1 and not self.backend_compiles_during_loop,
        )

    def to_dict(self) -> Dict[str, Any]:
        data = _encode(self)
        return {"schema_version": data.pop("schema_version"), **data}

    @classmethod
    def from_dict(cls, data: Dict[str, Any], where: str = "report") -> "RunRecord":
        """Read report.json data; a report without schema_version is a version-1 report from
        before the field existed. The summary is recomputed from the rows."""
        if not isinstance(data, dict):
            raise KitError(f"{where}: not a report (a JSON object was expected); re-run the job")
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise KitError(
                f"{where}: report schema_version {version!r} is newer than this kit reads "
                f"({SCHEMA_VERSION}); upgrade alpa_job to inspect it"
            )
        if "engine" not in data or "strategy" not in data:
            raise KitError(
                f"{where}: not a run report (no engine/strategy); point inspect at the --out of a "
                "train run or at an Alpa dump_debug_info folder"
            )
        try:
            record = _decode(cls, data)
        except (TypeError, ValueError, KeyError) as err:
            raise KitError(f"{where}: report does not match schema_version {version} ({err}); re-run the job to rewrite it") from None
        record.schema_version = SCHEMA_VERSION
        record.summary = record.summarize()
        return record


def load_schema() -> Dict[str, Any]:
    """The JSON Schema report.json follows (shipped as package data)."""
    with open(SCHEMA_PATH) as f:
        return json.load(f)


# ============================================================================ (de)serialization
def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_NOT_SERIALIZED = ("final_state",)


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name not in _NOT_SERIALIZED}
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


_HINTS: Dict[type, Dict[str, Any]] = {}


def _hints(cls: type) -> Dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls, vars(sys.modules[__name__]))
    return _HINTS[cls]


def _decode(tp: Any, data: Any) -> Any:
    """Plain JSON data -> the annotated type (dataclasses, Optional, List, Dict[str, X])."""
    if tp is Any or data is None:
        return data
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _decode(inner[0], data)
    if origin in (list, List):
        (item,) = typing.get_args(tp)
        return [_decode(item, v) for v in data]
    if origin in (dict, Dict):
        _key, item = typing.get_args(tp)
        return {k: _decode(item, v) for k, v in data.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(data, tp):  # already typed (e.g. ParallelPlan.leaf_records())
            return data
        if not isinstance(data, dict):
            raise TypeError(f"{tp.__name__}: expected an object, got {type(data).__name__}")
        if "from_plain" in vars(tp):
            return tp.from_plain(data)
        return _decode_fields(tp, data)
    return data


def _decode_fields(cls: type, data: Dict[str, Any]) -> Any:
    """A dataclass from its fields' data: unknown keys ignored, a null where the field is not
    Optional (older reports wrote `stages: null`) takes the field's default."""
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in _NOT_SERIALIZED or f.name not in data:
            continue
        value = data[f.name]
        if (
            value is None
            and not _optional(hints[f.name])
            and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
        ):
            continue
        values[f.name] = _decode(hints[f.name], value)
    return cls(**values)


def _optional(tp: Any) -> bool:
    return tp is Any or (typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp))
