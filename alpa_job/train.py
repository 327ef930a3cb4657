"""The training loop of one JAX process: data -> compiled step -> checkpoints -> statistics.

`train_process` is what runs on every node (in a Ray actor, or in-process for the embedded
default and benchmarks); it returns plain data, never formats a report.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Dict, List, Optional

from alpa_job import progress, versions
from alpa_job.data import epoch_batches, load_dataset, plan_epoch


def ensure_cpu_devices(count: int) -> None:
    """Emulate `count` CPU devices; must run before jax is first imported in this process."""
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [flag])


def init_distributed(coordinator: Optional[str], num_processes: int, process_id: int, timeout_s: int = 60) -> None:
    """Join the JAX processes of a multi-host job (no-op for one process)."""
    if num_processes <= 1:
        return
    import jax

    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s)


def _count_backend_compiles() -> List[int]:
    """A counter XLA backend compiles bump (proves the loop never recompiles)."""
    import jax

    counter = [0]

    def listener(event: str, *_args: Any, **_kwargs: Any) -> None:
        if "backend_compile" in event:
            counter[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    return counter


def train_process(config, process_id: int = 0, num_processes: int = 1,
                  coordinator: Optional[str] = None, return_state: bool = False) -> Dict[str, Any]:
    """Train on this process's devices; returns the run's statistics and plan as plain data.

    `return_state` adds the final TrainState under "final_state" (in-process callers only).
    """
    init_distributed(coordinator, num_processes, process_id)
    import jax

    from alpa_job.engines import auto_search
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.engines.sharding_rules import mesh_shape_for
    from alpa_job.inspect.hlo import count_collectives
    from alpa_job.models import get_model

    model = get_model(config)
    dataset = load_dataset(config)
    epoch = plan_epoch(dataset.num_samples, config.batch_size, config.remainder)
    total_steps = config.steps if config.steps is not None else config.epochs * epoch.steps
    example, _ = next(epoch_batches(dataset, config.batch_size, config.remainder, config.seed, 0))

    search_table = None
    if config.strategy == "auto":
        trial = [b for b, _ in _take(epoch_batches(dataset, config.batch_size, config.remainder, config.seed, 0), 2)]
        engine, search_table = auto_search.search(config, model, example, trial)
    else:
        engine = JaxEngine(config, model, example, config.strategy,
                           mesh_shape_for(config.strategy, len(jax.devices()), config.model_parallel))
        with progress.timed(f"compiling train step ({config.model}, {config.strategy}, mesh {engine.mesh.devices.shape})"):
            engine.compile()

    checkpointer = None
    if config.checkpoint_every:
        from alpa_job.checkpoint import Checkpointer

        checkpointer = Checkpointer(os.path.join(config.out, "checkpoints"), config.checkpoint_every)
    start_step = 0
    if config.resume:
        state = checkpointer.restore(engine.abstract_state)
        start_step = int(jax.device_get(state.step))
        progress.note(f"resumed from step {start_step} in {checkpointer.directory}")
    else:
        state = engine.init_state(config.seed)

    compiles_before_loop = _count_backend_compiles()
    stats = _loop(engine, state, dataset, epoch, config, start_step, total_steps, checkpointer)
    loop_compiles = compiles_before_loop[0]
    final_state = stats.pop("final_state")
    if checkpointer is not None:
        checkpointer.close()

    plan = engine.plan()
    return {
        "engine": "jax",
        "strategy": engine.strategy,
        "requested_strategy": config.strategy,
        "mesh": {"shape": list(engine.mesh.devices.shape), "axes": list(engine.mesh.axis_names)},
        "meshes": plan.mesh_rows(),
        "params": plan.leaf_rows(),
        "batch_sharding": plan.batch_rows(),
        "compiles": engine.stats.compiles,
        "backend_compiles_during_loop": loop_compiles,
        "compile_seconds": round(engine.stats.compile_seconds, 3),
        "collectives": count_collectives(engine.stats.hlo_text),
        "memory": engine.stats.memory,
        "search": search_table,
        "resumed_from_step": start_step if config.resume else None,
        "process": {"id": jax.process_index(), "count": jax.process_count(), "host": socket.gethostname(),
                    "ip": _node_ip(), "local_devices": [str(d) for d in jax.local_devices()],
                    "coordinator": coordinator},
        "devices": {"count": jax.device_count(), "platform": jax.devices()[0].platform,
                    "kind": jax.devices()[0].device_kind},
        "versions": versions.collect(),
        **stats,
        **({"final_state": final_state} if return_state else {}),
    }


def _loop(engine, state, dataset, epoch, config, start_step: int, total_steps: int, checkpointer) -> Dict[str, Any]:
    import jax

    steps = samples_seen = samples_dropped = 0
    losses: List[float] = []
    global_step = start_step
    bar = progress.Progress("train", total_steps - start_step)
    loop_start = time.perf_counter()
    while global_step < total_steps:
        epoch_index, skip = divmod(global_step, epoch.steps)
        pending = []
        for i, (batch, real) in enumerate(epoch_batches(dataset, config.batch_size, config.remainder,
                                                        config.seed, epoch_index)):
            if i < skip:
                continue
            if global_step >= total_steps:
                break
            state, loss = engine.step(state, engine.put_batch(batch))
            pending.append(loss)
            global_step += 1
            steps += 1
            samples_seen += real
            if checkpointer is not None:
                checkpointer.maybe_save(global_step, state)
            bar.update(1, epoch=epoch_index + 1)
        else:
            samples_dropped += epoch.samples_dropped  # the epoch ran to its end: its tail was dropped
        losses.extend(float(x) for x in jax.device_get(pending))  # one host sync per epoch
    jax.block_until_ready(state)
    loop_seconds = time.perf_counter() - loop_start
    bar.close()
    stats = loop_statistics(steps, samples_seen, samples_dropped, loop_seconds, losses)
    stats["final_state"] = state
    return stats


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


def _take(iterator, n: int):
    out = []
    for item in iterator:
        out.append(item)
        if len(out) == n:
            break
    return out


def _node_ip() -> Optional[str]:
    try:
        import ray

        # getattr: a stray ./ray folder (e.g. Ray's session dir under /tmp) imports as an empty package.
        if getattr(ray, "is_initialized", lambda: False)():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return None
