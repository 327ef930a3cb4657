"""The one training loop, for every engine: data -> compiled step -> checkpoints -> statistics.

`train_process` runs wherever an engine's step is driven from: on every node for the JAX engine
(one JAX process per node, in a Ray actor, or in-process for the embedded default and the
benchmarks), and on the driver for the Alpa engine (alpa.parallelize drives the whole cluster
from one process). It talks to the engine only through `engines.base.Engine` and returns plain
data; it never formats a report.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from alpa_job import strategies, versions
from alpa_job.progress.events import note, timed
from alpa_job.engines import device_pool
from alpa_job.train import hooks, own_network, timing
from alpa_job.data.pipeline import InputStream, Shard
from alpa_job.engines.base import Engine, check_supported
from alpa_job.engines.flops import matmul_dtype
from alpa_job.record.run_record import ProcessResult
from alpa_job.train.evaluate import Evaluator
from alpa_job.train.loop_metrics import LoopMetrics
from alpa_job.train.profile import StepProfile
from alpa_job.train.stragglers import StragglerWatch
from alpa_job.train.rundir import checkpoint_dir
from alpa_job.train.train_data import TrainData, input_record, prepare_data  # noqa: F401 - callers import them here


def _open_devices_early(config) -> None:
    """Start the JAX backend on a worker thread while this one imports flax and builds the model and
    the data: a GPU backend takes seconds to start. The thread then puts one small buffer on each local
    device: a device's allocator reserves its memory pool at its first allocation (most of a GPU, by
    default), not when the backend starts, and that otherwise falls on the state's initialisation; where
    an earlier identical run left its peak (engines/device_pool.py), it reserves that instead.
    build_jax_engine's own jax.devices() waits for the backend; a backend that fails to start fails
    there, with its error."""
    import jax

    reserved = device_pool.choose(config)  # before the backend starts: it reads the allocator's settings then
    if reserved:
        note(
            f"[alpa_job] GPU memory: {reserved / 1e9:.1f} GB reserved a device (the last identical run's peak), "
            f"growing on demand to the same limit ({device_pool.GROW}=false; set it yourself to choose)"
        )

    def open_devices() -> None:
        try:
            jax.devices()
            from alpa_job.engines import memory_fit

            memory_fit.remember_limits(jax.local_devices())  # before the pools are reserved (it says why)
            device_pool.first_buffers(jax.local_devices(), reserved)
        except Exception:  # noqa: BLE001 - reported by the main thread's own call
            pass

    threading.Thread(target=open_devices, name="open-devices", daemon=True).start()


# ----------------------------------------------------------------------------- engines
# An engine factory builds AND compiles: (config, model, data) -> a ready `Engine`.
EngineFactory = Callable[[Any, Any, TrainData], Engine]


def build_jax_engine(config, model, data: TrainData) -> Engine:
    """The JAX engine on this process's devices: the auto search's winner, or the named strategy."""
    import jax

    from alpa_job.engines.optimizer import schedule_steps

    horizon = schedule_steps(config, data.epoch.steps)
    started = time.perf_counter()
    devices = jax.devices()  # the first call starts the backend (a GPU: seconds)
    opened = time.perf_counter() - started
    if config.strategy == "auto":
        from alpa_job.engines import auto_search
        from alpa_job.planner import prefilter  # only auto asks it (its imports are the planner's)

        engine, table = auto_search.search(
            config, model, data.example, data.first(2), schedule_steps=horizon, prefilter=prefilter.for_auto(config, model, data.example)
        )
        engine.search_table = table
    else:
        _load_step_ahead(config, model, horizon, data.example, len(devices))
        from alpa_job.engines.jax_engine import JaxEngine

        engine = JaxEngine(
            config,
            model,
            data.example,
            config.strategy,
            strategies.get(config.strategy).mesh_shape(
                len(devices), config.model_parallel, jax.local_device_count(), config.pipeline_stages
            ),
            schedule_steps=horizon,
        )
        if starts_fresh(config):
            engine.init_state_ahead(config.seed)  # made beside the step's load (_first_state takes it)
        with timed(f"compiling train step ({config.model}, {config.strategy}, mesh {engine.mesh.devices.shape})"):
            engine.compile()
        from alpa_job.engines import executable_store

        executable_store.drop_ahead()  # the engine took its step, or the key differed
    engine.stats.setup_phases["open_devices"] = opened
    return engine


def _load_step_ahead(config, model, horizon, example, device_count: int) -> None:
    """A named strategy's stored step starts loading on a worker thread now, while the engine's modules import
    and it builds the model's abstract state (executable_store.load_ahead); its key is the one the engine
    builds (`JaxEngine._store_for`), so the engine's load takes it."""
    import jax

    from alpa_job.engines import compile_cache, executable_store, layer_gather
    from alpa_job.engines.device_mesh import make_mesh

    cache_dir = compile_cache.enable(compile_cache.resolve(getattr(config, "compile_cache", None)))
    if not cache_dir or not executable_store.StepStore.supported():
        return
    record = strategies.get(config.strategy)
    mesh = make_mesh(
        record.mesh_shape(device_count, config.model_parallel, jax.local_device_count(), config.pipeline_stages), record.mesh_axes
    )
    per_layer = layer_gather.starts_per_layer(config, record, model)
    executable_store.load_ahead(executable_store.store_for(cache_dir, config, horizon, config.strategy, mesh, example, per_layer))


# ----------------------------------------------------------------------------- the process
def train_process(
    config,
    coordinator: Optional[str] = None,
    return_state: bool = False,
    build_engine: Optional[EngineFactory] = None,
    on_step: Optional[Callable[[int], None]] = None,
    stop=None,
) -> ProcessResult:
    """Train with the engine `build_engine` makes (default: the JAX engine on this process's
    devices); returns this process's statistics and plan (`ProcessResult`, plain data).

    A process of a multi-process job has already joined the others (the worker group's actor
    starts jax.distributed before calling this); `coordinator` is the address it joined, for the
    result. `return_state` keeps the final train state in `final_state` (in-process callers only).
    `on_step(global_step)` is called after each step is dispatched (no host sync): the driver's
    failure reports read it (alpa_job.launch.worker_group). `stop` (a train.stop.StopPoint) ends the
    run early at a step every process agreed on, with a checkpoint there (preemption).
    """
    started, before_train = time.perf_counter(), timing.process_age_s()  # Python, the CLI, checks, imports
    if build_engine is None:
        _open_devices_early(config)
    from alpa_job.models import get_model

    model = get_model(config)
    data = prepare_data(config, model)
    total_steps = config.steps if config.steps is not None else config.epochs * data.epoch.steps
    notes = checkpoint_notes(config, total_steps)
    startup = time.perf_counter() - started  # imports, the model, the data
    engine = (build_engine or build_jax_engine)(config, model, data)
    if not isinstance(engine, Engine):  # an Engine subclass that lacks a member cannot be made at all
        raise TypeError(f"{type(engine).__name__} is not an alpa_job.engines.base.Engine: subclass it and implement its abstract members")
    check_supported(config, engine)
    engine_notes = engine.notes()
    for line in engine_notes:
        note(f"[alpa_job] note: {line}")
    notes += engine_notes

    # Every process compiled before anything spans them: orbax's checkpoint manager syncs the processes
    # through a collective as it opens, and a new group of CPU collectives allows its peers 30 s to arrive.
    engine.wait_for_every_process()
    checkpointer = None
    if config.checkpoint_every:
        from alpa_job.train.checkpoint import Checkpointer

        checkpointer = Checkpointer(checkpoint_dir(config.out), config.checkpoint_every)
    built = time.perf_counter()
    state, start_step, data_state = _first_state(config, engine, checkpointer)
    phases = {
        "before_train": before_train,
        "startup": startup,
        **engine.stats.setup_phases,
        "setup_and_compile": built - started,
        "compile": engine.stats.compile_seconds,
        "init_compile": getattr(engine.stats, "init_compile_seconds", None),
        "init_or_restore": time.perf_counter() - built,
    }

    topology = engine.topology()  # read once: the loop's hooks, the data shard and the timing all use it
    process, devices = topology["process"], topology["devices"]
    seq_len = _seq_len(config)
    network = own_network.measure(config, process["count"]) if engine.name == "jax" else (None, None)
    shard = Shard(process["id"], process["count"])
    stream = data.stream(total_steps, shard)
    stream.check_state(data_state, start_step)
    evaluator = Evaluator(engine, data, config, shard)
    metrics = LoopMetrics.for_run(config, engine, data, seq_len)
    metrics.setup(start_step, phases)
    watch = StragglerWatch.for_run(config, engine, process["count"])
    read_before = (data.source.rows_read, data.source.bytes_read)
    compiles_since = engine.watch_compiles()
    profile = StepProfile.from_config(config)
    run_hooks = loop_hooks(
        stream,
        start_step,
        total_steps,
        checkpointer,
        on_step=on_step,
        evaluator=evaluator,
        stop=stop,
        watch=watch,
        profile=profile,
        tokens_per_sample=seq_len,
        devices=devices.get("count") or 1,
    )
    try:
        state, looped = run_loop(engine, state, stream, start_step, total_steps, run_hooks, metrics, checkpointer)
    except BaseException:
        if checkpointer is not None:
            checkpointer.abandon()  # bounded; a save that cannot finish never holds the failing run
        raise
    loop_compiles = compiles_since()
    if looped.stopped_at is not None:
        checkpointer = save_at_stop(config, checkpointer, looped.stopped_at, state, stream)
    if checkpointer is not None:
        checkpointer.close()
    eval_loss = evaluator.points[-1].loss if evaluator.points else engine.eval_loss(state, data.example)

    first_done = looped.first_step_done_at
    phases["first_step"] = looped.first_step_s
    phases["to_first_step"] = first_done - started if first_done is not None else None
    # The same from the process's start: Python, imports and (in a Ray actor) the worker's start too.
    phases["process_to_first_step"] = looped.process_age_at_first_step
    read = input_record(data, stream, read_before, start_step, total_steps, looped.loop_seconds)
    peak_bytes = engine.peak_memory_bytes()
    if build_engine is None:
        device_pool.remember(config, peak_bytes, devices.get("platform", ""))
    run_timing = timing.summary(
        phases,
        looped.window_step_s,
        engine.stats.flops_per_step,
        devices.get("kind"),
        matmul_dtype(config),
        devices.get("count") or 1,
        peak_bytes,
        (engine.stats.memory or {}).get("peak_estimate_bytes"),
        samples_per_step=looped.samples_seen / looped.steps if looped.steps else None,
        tokens_per_sample=seq_len,
        causal_attention_flops=engine.stats.causal_attention_flops_per_step,
    )
    run_timing["compile_cache"] = engine.stats.cache_report()
    profiled = profile.summary() if profile is not None else None
    if profiled is not None:
        run_timing["profile"] = profiled
    result = _result(
        config,
        engine,
        coordinator,
        loop_compiles,
        start_step,
        eval_loss,
        looped.statistics(),
        evals=evaluator.points,
        notes=notes,
        network_measured=network[0],
        stragglers=watch.summary() if watch is not None else None,
        stopped_at_step=looped.stopped_at,
        input=read,
        timing=run_timing,
        process_extra={
            "nccl": network[1],
            "stopped_at_step": looped.stopped_at,
            "rows_read": read.rows_read,
            "bytes_read": read.bytes_read,
            "step_source": engine.stats.step_source,
        },
    )
    if config.out:
        engine.finish(config.out)
    if return_state:
        result.final_state = state
    return result


def _seq_len(config) -> Optional[int]:
    """Tokens a sample, for a model that declares a sequence length (tokens/s); None for the others."""
    from alpa_job.data.open import model_setting

    seq_len = model_setting(config, "seq_len")
    return int(seq_len) if isinstance(seq_len, int) else None


def checkpoint_notes(config, total_steps: int) -> List[str]:
    """A warning, printed now (before the compile) and kept for the report, when --checkpoint-every
    names no step this run reaches: the user asked for checkpoints and would otherwise find none."""
    every = config.checkpoint_every
    if not every:
        return []
    start = 0
    if config.resume:
        from alpa_job.train.checkpoint_files import latest_complete_step

        start = latest_complete_step(checkpoint_dir(config.out)) or 0
    if start >= total_steps or total_steps // every > start // every:
        return []
    text = (
        f"warning: --checkpoint-every {every} never saves: this run ends at step {total_steps}"
        + (f" (it resumes from step {start})" if start else "")
        + f"; pass --checkpoint-every {total_steps - start} or less (or more --steps) to keep a checkpoint"
    )
    note(text)
    return [text]


def starts_fresh(config) -> bool:
    """Whether the run's first state is made from random parameters (_first_state: not restored from a
    checkpoint, not read from a Hugging Face checkpoint's weights)."""
    return not config.resume and not getattr(config, "init_from", None)


def _first_state(config, engine: Engine, checkpointer) -> Tuple[Any, int, Optional[Dict[str, Any]]]:
    """(state, its step, the input stream's saved state): from the last complete checkpoint with
    --resume, else fresh."""
    if config.resume:
        state, data_state = checkpointer.restore(engine.abstract_state)
        start_step = int(engine.to_floats([state.step])[0])
        note(f"resumed from step {start_step} in {checkpointer.directory}")
        return state, start_step, data_state
    if getattr(config, "init_from", None):
        from alpa_job.hf.checkpoint import HfCheckpoint, parse_source
        from alpa_job.hf.load import read_params

        source = parse_source(config.init_from)
        state = engine.state_from_params(lambda layout: read_params(HfCheckpoint(source), engine.model.hf, layout, config.model))
        note(f"[alpa_job] weights from the Hugging Face checkpoint in {source}")
    else:
        state = engine.init_state(config.seed)
    engine.wait(state)
    return state, 0, None


@dataclasses.dataclass
class LoopResult:
    """What a loop returns besides the state: its counts, losses and timing, and how it ended."""

    steps: int
    samples_seen: int
    samples_dropped: int
    loop_seconds: float
    losses: List[float]
    window_step_s: List[float]
    first_step_s: Optional[float]
    first_step_done_at: Optional[float]  # perf_counter when the first step was done (None: no step ran)
    process_age_at_first_step: Optional[float]
    stopped_at: Optional[int]  # the step a stop point ended the run at (preemption)

    def statistics(self) -> Dict[str, Any]:
        """The report's loop numbers, computed the same way for every engine."""
        return loop_statistics(self.steps, self.samples_seen, self.samples_dropped, self.loop_seconds, self.losses)


def loop_hooks(
    stream: InputStream,
    start_step: int,
    total_steps: int,
    checkpointer=None,
    on_step: Optional[Callable[[int], None]] = None,
    evaluator: Optional[Evaluator] = None,
    stop=None,
    watch: Optional[StragglerWatch] = None,
    profile: Optional[StepProfile] = None,
    tokens_per_sample: Optional[int] = None,
    devices: int = 1,
) -> List[hooks.Hook]:
    """The loop's hooks for this run, in the order that keeps its numbers right (train/hooks.py)."""
    chosen: List[hooks.Hook] = []
    if profile is not None:
        chosen.append(hooks.ProfileHook(profile))
    if checkpointer is not None:
        chosen.append(hooks.CheckpointHook(checkpointer, stream))
    if on_step is not None:
        chosen.append(hooks.CallbackHook(on_step))
    chosen.append(hooks.StepTimer(total_steps - start_step))
    if evaluator is not None:
        chosen.append(hooks.EvalHook(evaluator))
    if watch is not None:
        chosen.append(hooks.StragglerHook(watch))
    chosen.append(hooks.ProgressHook(stream.epoch.steps, tokens_per_sample, devices))
    if stop is not None:
        chosen.append(hooks.StopHook(stop))
    return chosen


def run_loop(
    engine: Engine,
    state: Any,
    stream: InputStream,
    start_step: int,
    total_steps: int,
    run_hooks: List[hooks.Hook],
    metrics: Optional[LoopMetrics] = None,
    checkpointer=None,
) -> Tuple[Any, LoopResult]:
    """Steps `start_step`..`total_steps` over this process's share of fixed-shape batches, each followed by
    the hooks that are due; returns (final state, LoopResult). `metrics` gets the numbers the loop has on the
    host anyway (the losses it reads back, each timing window) for the run's metrics log.

    The stream is a pure function of (seed, step), and its position is saved with every checkpoint, so
    a resumed run continues the exact batch sequence."""
    loop = hooks.Loop(engine, state, start_step, total_steps, metrics, checkpointer)
    for hook in run_hooks:
        hook.start(loop)
    started = time.perf_counter()
    batches = stream.batches(start_step)
    while loop.stopped_at is None:
        fetch_started = time.perf_counter()
        try:
            batch, real = next(batches)
        except StopIteration:
            break
        for hook in run_hooks:
            hook.before_step(loop)
        placed = engine.put_batch(batch)
        loop.input_seconds += time.perf_counter() - fetch_started  # this process's own input work
        loop.state, loss = engine.step(loop.state, placed)
        loop.dispatched(loss, real, stream.epoch.steps, stream.epoch.samples_dropped)
        for hook in run_hooks:
            if hook.due(loop):
                hook.after_step(loop)
    loop.read_back()
    for hook in run_hooks:
        hook.finish(loop)
    engine.wait(loop.state)
    timer = loop.timer  # the StepTimer hook registered itself when it started
    return loop.state, LoopResult(
        steps=loop.steps,
        samples_seen=loop.samples_seen,
        samples_dropped=loop.samples_dropped,
        loop_seconds=time.perf_counter() - started,
        losses=loop.losses,
        window_step_s=timer.window_step_s,
        first_step_s=timer.first_step_s,
        first_step_done_at=timer.first_done,
        process_age_at_first_step=timer.process_age,
        stopped_at=loop.stopped_at,
    )


def save_at_stop(config, checkpointer, step: int, state: Any, stream: InputStream):
    """A run stopped early (preempted) saves the step it stopped at, with or without --checkpoint-every, so
    `--resume` continues from there; returns the checkpointer (made here when the run had none)."""
    if checkpointer is None:
        from alpa_job.train.checkpoint import Checkpointer

        checkpointer = Checkpointer(checkpoint_dir(config.out), 0)
    with timed(f"saving checkpoint {step} before stopping"):
        checkpointer.save_now(step, state, stream.state(step))
        checkpointer.manager.wait_until_finished()  # the save is asynchronous: the message means it is on disk
    return checkpointer


def loop_statistics(steps: int, samples_seen: int, samples_dropped: int, loop_seconds: float, losses: List[float]) -> Dict[str, Any]:
    """The report's loop numbers, computed the same way for every engine."""
    return {
        "steps": steps,
        "samples_seen": samples_seen,
        "samples_dropped": samples_dropped,
        "loop_seconds": round(loop_seconds, 4),
        "step_time_s": round(loop_seconds / steps, 6) if steps else None,
        "throughput": round(samples_seen / loop_seconds, 2) if steps and loop_seconds > 0 else None,
        "losses": [round(x, 6) for x in losses],
    }


def _result(
    config,
    engine: Engine,
    coordinator: Optional[str],
    loop_compiles: int,
    start_step: int,
    eval_loss: Optional[float],
    loop_stats: Dict[str, Any],
    process_extra: Optional[Dict[str, Any]] = None,
    **run_fields: Any,
) -> ProcessResult:
    """One process's result, built once: the same fields for every engine, the run's (`run_fields`: evals,
    timing, input, ...), this process's extras, and the engine's own."""
    topology = engine.topology()
    plan = engine.plan()
    stats = engine.stats
    process = topology["process"]
    fields = {
        "engine": engine.name,
        "strategy": engine.strategy,
        "requested_strategy": config.strategy,
        "mesh": topology["mesh"],
        "meshes": plan.mesh_rows(),
        "params": plan.leaf_rows(),
        "batch_sharding": plan.batch_rows(),
        "compiles": stats.compiles,
        "backend_compiles_during_loop": loop_compiles,
        "compile_seconds": round(stats.compile_seconds, 3),
        "collectives": stats.collectives(),
        "memory": stats.memory,
        "search": None,
        "resumed_from_step": start_step if config.resume else None,
        "process": {
            "id": process["id"],
            "count": process["count"],
            "host": socket.gethostname(),
            "ip": _node_ip(),
            "local_devices": process["local_devices"],
            "coordinator": coordinator,
            **(process_extra or {}),
        },
        "devices": topology["devices"],
        "versions": versions.collect(),
        "eval_loss": eval_loss,
        **loop_stats,
        **run_fields,
    }
    fields.update(engine.extra_report())
    return ProcessResult.coerce(fields)  # plain rows -> the record's typed rows


def _node_ip() -> Optional[str]:
    # A process that never imported Ray is not in a Ray cluster; importing it only to ask takes half a second.
    ray = sys.modules.get("ray")
    # getattr: a stray ./ray folder (e.g. Ray's session dir under /tmp) imports as an empty package.
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return ray.util.get_node_ip_address()
    return None
