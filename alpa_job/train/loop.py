"""The one training loop, for every engine: data -> compiled step -> checkpoints -> statistics.

`train_process` runs wherever an engine's step is driven from: on every node for the JAX engine
(one JAX process per node, in a Ray actor, or in-process for the embedded default and the
benchmarks), and on the driver for the Alpa engine (alpa.parallelize drives the whole cluster
from one process). It talks to the engine only through `engines.base.Engine` and returns plain
data; it never formats a report.
"""
from __future__ import annotations

import bisect
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from alpa_job import progress, strategies, versions
from alpa_job.train import own_network, timing
from alpa_job.data.pipeline import InputStream, Shard
from alpa_job.engines.base import Engine, check_supported
from alpa_job.record.run_record import ProcessResult
from alpa_job.train.divergence import check_finite
from alpa_job.train.evaluate import Evaluator
from alpa_job.train.loop_metrics import LoopMetrics
from alpa_job.train.profile import StepProfile
from alpa_job.train.stragglers import StragglerWatch
from alpa_job.train.rundir import checkpoint_dir
from alpa_job.train.train_data import TrainData, input_record, prepare_data  # noqa: F401 - callers import them here



def ensure_cpu_devices(count: int) -> None:
    """Emulate `count` CPU devices; nothing once jax is imported in this process (its caller's devices stand)."""
    if "jax" in sys.modules:
        return
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [flag])


def _open_devices_early() -> None:
    """Start the JAX backend on a worker thread while this one imports flax and builds the model and
    the data: a GPU backend takes seconds to start (one H100: ~2.5 s). build_jax_engine's own
    jax.devices() then waits for it; a backend that fails to start fails there, with its error."""
    import jax

    def open_devices() -> None:
        try:
            jax.devices()
        except Exception:  # noqa: BLE001 - reported by the main thread's own call
            pass

    threading.Thread(target=open_devices, name="open-devices", daemon=True).start()


# ----------------------------------------------------------------------------- engines
# An engine factory builds AND compiles: (config, model, data) -> a ready `Engine`.
EngineFactory = Callable[[Any, Any, TrainData], Engine]


def build_jax_engine(config, model, data: TrainData) -> Engine:
    """The JAX engine on this process's devices: the auto search's winner, or the named strategy."""
    import jax

    from alpa_job.engines import auto_search
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.engines.optimizer import schedule_steps

    horizon = schedule_steps(config, data.epoch.steps)
    started = time.perf_counter()
    devices = jax.devices()  # the first call starts the backend (a GPU: seconds)
    opened = time.perf_counter() - started
    if config.strategy == "auto":
        from alpa_job.planner import prefilter  # only auto asks it (its imports are the planner's)

        engine, table = auto_search.search(config, model, data.example, data.first(2), schedule_steps=horizon,
                                           prefilter=prefilter.for_auto(config, model, data.example))
        engine.search_table = table
    else:
        engine = JaxEngine(config, model, data.example, config.strategy,
                           strategies.get(config.strategy).mesh_shape(len(devices), config.model_parallel,
                                                                      jax.local_device_count(),
                                                                      config.pipeline_stages),
                           schedule_steps=horizon)
        with progress.timed(f"compiling train step ({config.model}, {config.strategy}, "
                            f"mesh {engine.mesh.devices.shape})"):
            engine.compile()
    engine.stats.setup_phases["open_devices"] = opened
    return engine


# ----------------------------------------------------------------------------- the process
def train_process(config, coordinator: Optional[str] = None, return_state: bool = False,
                  build_engine: Optional[EngineFactory] = None,
                  on_step: Optional[Callable[[int], None]] = None, stop=None) -> ProcessResult:
    """Train with the engine `build_engine` makes (default: the JAX engine on this process's
    devices); returns this process's statistics and plan (`ProcessResult`, plain data).

    A process of a multi-process job has already joined the others (the worker group's actor
    starts jax.distributed before calling this); `coordinator` is the address it joined, for the
    result. `return_state` keeps the final train state in `final_state` (in-process callers only).
    `on_step(global_step)` is called after each step is dispatched (no host sync): the driver's
    failure reports read it (alpa_job.launch.worker_group). `stop` (a train.stop.StopPoint) ends the
    run early at a step every process agreed on, with a checkpoint there (preemption).
    """
    started = time.perf_counter()
    if build_engine is None:
        _open_devices_early()
    from alpa_job.models import get_model

    model = get_model(config)
    data = prepare_data(config, model)
    total_steps = config.steps if config.steps is not None else config.epochs * data.epoch.steps
    notes = checkpoint_notes(config, total_steps)
    startup = time.perf_counter() - started  # imports, the model, the data
    engine = (build_engine or build_jax_engine)(config, model, data)
    if not isinstance(engine, Engine):  # an Engine subclass that lacks a member cannot be made at all
        raise TypeError(f"{type(engine).__name__} is not an alpa_job.engines.base.Engine: subclass it "
                        "and implement its abstract members")
    check_supported(config, engine)

    checkpointer = None
    if config.checkpoint_every:
        from alpa_job.train.checkpoint import Checkpointer

        checkpointer = Checkpointer(checkpoint_dir(config.out), config.checkpoint_every)
    built = time.perf_counter()
    state, start_step, data_state = _first_state(config, engine, checkpointer)
    phases = {"startup": startup, **engine.stats.setup_phases,
              "setup_and_compile": built - started, "compile": engine.stats.compile_seconds,
              "init_compile": getattr(engine.stats, "init_compile_seconds", None),
              "init_or_restore": time.perf_counter() - built}

    process = engine.topology()["process"]
    network = own_network.measure(config, process["count"]) if engine.name == "jax" else (None, None)
    shard = Shard(process["id"], process["count"])
    stream = data.stream(total_steps, shard)
    stream.check_state(data_state, start_step)
    evaluator = Evaluator(engine, data, config, shard)
    metrics = _loop_metrics(config, engine, data)
    metrics.setup(start_step, phases)
    watch = StragglerWatch.for_run(config, engine, process["count"])
    read_before = (data.source.rows_read, data.source.bytes_read)
    compiles_since = engine.watch_compiles()
    try:
        state, stats = run_loop(engine, state, stream, start_step, total_steps, checkpointer, on_step=on_step,
                                evaluator=evaluator, stop=stop, metrics=metrics, config=config, watch=watch)
    except BaseException:
        if checkpointer is not None:
            checkpointer.abandon()  # bounded; a save that cannot finish never holds the failing run
        raise
    loop_compiles = compiles_since()
    stopped_at = stats.pop("stopped_at")
    profiled = stats.pop("profile")
    if stopped_at is not None:
        checkpointer = save_at_stop(config, checkpointer, stopped_at, state, stream)
    if checkpointer is not None:
        checkpointer.close()
    eval_loss = evaluator.points[-1].loss if evaluator.points else engine.eval_loss(state, data.example)

    first_done = stats.pop("first_step_done_at")
    phases["first_step"] = stats.pop("first_step_s")
    phases["to_first_step"] = first_done - started if first_done is not None else None
    # The same from the process's start: Python, imports and (in a Ray actor) the worker's start too.
    phases["process_to_first_step"] = stats.pop("process_age_at_first_step")
    result = _result(config, engine, coordinator, loop_compiles, start_step, eval_loss, stats)
    result.evals = evaluator.points
    result.notes = notes
    result.network_measured, result.process.nccl = network
    result.stragglers = watch.summary() if watch is not None else None
    result.stopped_at_step = stopped_at
    result.process.stopped_at_step = stopped_at
    result.input = input_record(data, stream, read_before, start_step, total_steps, stats["loop_seconds"])
    result.process.rows_read, result.process.bytes_read = result.input.rows_read, result.input.bytes_read
    result.timing = timing.summary(
        phases, stats["window_step_s"], engine.stats.flops_per_step, result.devices.kind, config.dtype,
        result.devices.count or 1, engine.peak_memory_bytes(),
        (engine.stats.memory or {}).get("peak_estimate_bytes"),
        samples_per_step=stats["samples_seen"] / stats["steps"] if stats["steps"] else None)
    result.timing["compile_cache"] = engine.stats.cache_report()
    if profiled is not None:
        result.timing["profile"] = profiled
    if config.out:
        engine.finish(config.out)
    if return_state:
        result.final_state = state
    return result


def _loop_metrics(config, engine: Engine, data: TrainData) -> LoopMetrics:
    from alpa_job.data.open import model_setting

    seq_len = model_setting(config, "seq_len")
    return LoopMetrics.for_run(config, engine, data, int(seq_len) if isinstance(seq_len, int) else None)


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
    text = (f"warning: --checkpoint-every {every} never saves: this run ends at step {total_steps}"
            + (f" (it resumes from step {start})" if start else "")
            + f"; pass --checkpoint-every {total_steps - start} or less (or more --steps) to keep a checkpoint")
    progress.note(text)
    return [text]


def _first_state(config, engine: Engine, checkpointer) -> Tuple[Any, int, Optional[Dict[str, Any]]]:
    """(state, its step, the input stream's saved state): from the last complete checkpoint with
    --resume, else fresh."""
    engine.wait_for_every_process()  # the first program spanning processes runs below
    if config.resume:
        state, data_state = checkpointer.restore(engine.abstract_state)
        start_step = int(engine.to_floats([state.step])[0])
        progress.note(f"resumed from step {start_step} in {checkpointer.directory}")
        return state, start_step, data_state
    state = engine.init_state(config.seed)
    engine.wait(state)
    return state, 0, None


def run_loop(engine: Engine, state: Any, stream: InputStream, start_step: int, total_steps: int,
             checkpointer=None, on_step: Optional[Callable[[int], None]] = None,
             evaluator: Optional[Evaluator] = None, stop=None,
             metrics: Optional[LoopMetrics] = None, config=None,
             watch: Optional[StragglerWatch] = None) -> Tuple[Any, Dict[str, Any]]:
    """Steps `start_step`..`total_steps` over this process's share of fixed-shape batches; returns
    (final state, loop statistics). `metrics` gets the numbers the loop has on the host anyway (the
    losses it reads back, each timing window) for the run's metrics log.

    The stream is a pure function of (seed, step), and its position is saved with every checkpoint, so
    a resumed run continues the exact batch sequence. `watch` (several processes) times each process's own
    share every few steps and names a slow one (train/stragglers.py)."""
    steps = samples_seen = samples_dropped = 0
    losses: List[float] = []
    global_step = start_step
    steps_per_epoch = stream.epoch.steps
    bar = progress.Progress("train", total_steps - start_step, first=start_step)
    # Timing without a per-step sync: the first step alone, then one sync per window (timing.py).
    window, window_step_s = timing.window_size(total_steps - start_step), []
    ordered: List[float] = []  # window_step_s sorted: the steady median for every progress event, cheaply
    first_step_s = first_done = process_age = None
    mark_step = 0  # the step (counted in this run) whose completion `mark` timed
    loop_start = mark = time.perf_counter()
    pending: List[Any] = []  # losses still on the device, oldest first
    mark_samples = 0  # samples_seen when `mark` was taken (a window's throughput)

    def read_back(count: int) -> List[float]:
        # The oldest `count` pending losses in one host sync, checked: a non-finite one stops the run.
        first = global_step - len(pending) + 1
        values = engine.to_floats(pending[:count])
        del pending[:count]
        losses.extend(values)
        if metrics is not None:  # before the check: a diverged run's curve ends with its non-finite loss
            metrics.losses(first, values)
        check_finite(values, first, global_step, checkpointer, losses)
        return values

    def close_window(steps_at: int, timed_step: int, samples_at: int) -> None:
        # A timing window ends now (its last step synced): its per-step time, the sorted copy the
        # progress line's median reads, the metrics log; the next window starts here.
        nonlocal mark, mark_step, mark_samples
        now = time.perf_counter()
        window_step_s.append((now - mark) / window)
        bisect.insort(ordered, window_step_s[-1])
        if metrics is not None:
            metrics.window(timed_step, window, now - mark, samples_at - mark_samples)
        mark, mark_step, mark_samples = now, steps_at, samples_at
    stopped_at = None

    profile = StepProfile.from_config(config) if config is not None else None
    batches = stream.batches(start_step)
    while True:
        fetch_started = time.perf_counter()
        try:
            batch, real = next(batches)
        except StopIteration:
            break
        if profile is not None:
            profile.before_step(global_step + 1)
        placed = engine.put_batch(batch)
        if watch is not None:  # this process's own input work: what a slow disk or CPU stretches
            watch.input_time(time.perf_counter() - fetch_started)
        state, loss = engine.step(state, placed)
        if profile is not None:
            profile.after_step(global_step + 1, engine, state)
        pending.append(loss)
        global_step += 1
        steps += 1
        samples_seen += real
        if global_step % steps_per_epoch == 0:
            samples_dropped += stream.epoch.samples_dropped  # the epoch ran to its end: its tail was dropped
        fresh = None  # losses read back at this step (the progress line shows the newest)
        if checkpointer is not None:
            if checkpointer.every and global_step % checkpointer.every == 0:
                fresh = read_back(len(pending))  # a checkpoint never holds a state past a non-finite loss
            checkpointer.maybe_save(global_step, state, stream.state(global_step))
        if on_step is not None:
            on_step(global_step)
        if first_done is None:
            fresh = read_back(len(pending)) or fresh  # sync: the first step is done
            now = time.perf_counter()
            first_step_s, first_done, process_age = now - loop_start, now, timing.process_age_s()
            mark, mark_step, mark_samples = now, steps, samples_seen
            if metrics is not None:
                metrics.first_step(global_step, first_step_s)
        elif steps - 1 - mark_step == window:
            # Sync on the step before this one: this one is already queued, so the device does not
            # idle while the host reads the clock and dispatches again (a sync on the newest step
            # drains the queue every window: ~3 ms a step on GPT 24L, one H100). The losses up to
            # that step come back in the same sync.
            fresh = read_back(len(pending) - 1) or fresh
            close_window(steps - 1, global_step - 1, samples_seen - real)
        if first_done is not None and global_step == total_steps and steps - mark_step == window:
            # the last window ends with the run: closed here, so the last progress event's rate counts it too
            fresh = read_back(len(pending)) or fresh
            close_window(steps, global_step, samples_seen)
        if evaluator is not None and evaluator.due(global_step, global_step == total_steps):
            point = evaluator(global_step, state)
            if point is not None:
                bar.set_eval(point.loss, point.perplexity)
                if metrics is not None:
                    metrics.evaluation(point)
            if first_done is not None:  # the eval's time is not a step's: the timing window restarts here
                mark, mark_step, mark_samples = time.perf_counter(), steps, samples_seen
        if watch is not None and first_done is not None and watch.due(global_step) and global_step < total_steps:
            # Its probe times the devices idle: every queued step done first (the newest loss read back).
            fresh = read_back(len(pending)) or fresh
            # The probe's time is not a step's: the timing window's start moves past it.
            mark += watch(global_step, timing.percentile_sorted(ordered, 0.5) if ordered else None)
            bar.set_alert(watch.alert())
        bar.update(1, epoch=(global_step - 1) // steps_per_epoch + 1, loss=loss, samples=real,
                   read_loss=fresh[-1] if fresh else None,
                   step_s=timing.percentile_sorted(ordered, 0.5) if ordered else None)
        if stop is not None and global_step < total_steps and stop.after_step(global_step):
            stopped_at = global_step
            break
    read_back(len(pending))
    if profile is not None:
        profile.stop(engine, state)  # a run that ended (or stopped) inside the traced steps
    if first_done is not None and steps - mark_step == window:  # a run stopped early: its last window ends here
        close_window(steps, global_step, samples_seen)
    engine.wait(state)
    loop_seconds = time.perf_counter() - loop_start
    bar.close()
    stats = loop_statistics(steps, samples_seen, samples_dropped, loop_seconds, losses)
    stats.update(first_step_s=first_step_s, first_step_done_at=first_done, window_step_s=window_step_s,
                 process_age_at_first_step=process_age, stopped_at=stopped_at,
                 profile=profile.summary() if profile is not None else None)
    return state, stats


def save_at_stop(config, checkpointer, step: int, state: Any, stream: InputStream):
    """A run stopped early (preempted) saves the step it stopped at, with or without --checkpoint-every, so
    `--resume` continues from there; returns the checkpointer (made here when the run had none)."""
    if checkpointer is None:
        from alpa_job.train.checkpoint import Checkpointer

        checkpointer = Checkpointer(checkpoint_dir(config.out), 0)
    with progress.timed(f"saving checkpoint {step} before stopping"):
        checkpointer.save_now(step, state, stream.state(step))
        checkpointer.manager.wait_until_finished()  # the save is asynchronous: the message means it is on disk
    return checkpointer


def loop_statistics(steps: int, samples_seen: int, samples_dropped: int, loop_seconds: float,
                    losses: List[float]) -> Dict[str, Any]:
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


def _result(config, engine: Engine, coordinator: Optional[str], loop_compiles: int, start_step: int,
            eval_loss: Optional[float], loop_stats: Dict[str, Any]) -> ProcessResult:
    """One process's result: the same fields for every engine, plus the engine's extras."""
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
        "process": {"id": process["id"], "count": process["count"], "host": socket.gethostname(),
                    "ip": _node_ip(), "local_devices": process["local_devices"], "coordinator": coordinator},
        "devices": topology["devices"],
        "versions": versions.collect(),
        "eval_loss": eval_loss,
        **loop_stats,
    }
    fields.update(engine.extra_report())
    return ProcessResult.coerce(fields)  # plain rows -> the record's typed rows


def _node_ip() -> Optional[str]:
    try:
        import ray

        # getattr: a stray ./ray folder (e.g. Ray's session dir under /tmp) imports as an empty package.
        if getattr(ray, "is_initialized", lambda: False)():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return None
