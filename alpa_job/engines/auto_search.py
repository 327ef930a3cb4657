"""`--strategy auto`: an honest small version of Alpa's profile-guided search.

Every candidate strategy x mesh shape is built abstractly first (no compile): one whose state alone
exceeds a device's budget is dropped there, and on a cluster of several processes the planner
(alpa_job.planner) drops those it predicts cannot fit or are far slower than the best. The rest
compile together, XLA compiling outside the GIL (on GPUs after the first alone: compile_schedule),
those whose XLA memory estimate fits are timed over a few real steps, and the fastest wins. The
table of every candidate goes in the report, and the result is kept beside the compile cache, so a
second identical run trains its winner straight away.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np

from alpa_job.engines import compile_cache, memory_fit
from alpa_job.engines.executable_store import key_digest, step_key
from alpa_job.engines.jax_engine import JaxEngine, make_mesh
from alpa_job.engines.sharding_rules import auto_candidates
from alpa_job.errors import KitError
from alpa_job.progress import Progress, phase

SEARCH_DIR = "auto-search"


def device_memory_budget(limit_gb: Optional[float]) -> int:
    """Bytes one device may use: the flag, else the device's own limit, else RAM / local devices."""
    if limit_gb is not None:
        return int(limit_gb * 1e9)
    stats = None
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - CPU devices have no memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    # All the RAM, not what is available now (memory_fit.budget's figure for its check): this budget is
    # part of the saved search's key, which must not move between two identical runs.
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(len(jax.local_devices()), 1)


def search(config, model, example_batch, batches, schedule_steps: Optional[int] = None
           ) -> Tuple[JaxEngine, List[Dict[str, object]]]:
    """Return the fastest fitting engine (compiled) and the table of every candidate.
    `schedule_steps`: the learning-rate schedule's horizon (JaxEngine)."""
    budget = device_memory_budget(config.memory_limit_gb)
    candidates = auto_candidates(len(jax.devices()), jax.local_device_count())
    saved = SavedSearch.open(config, schedule_steps, candidates, example_batch, budget)
    reused = saved.load() if saved is not None else None
    if reused is not None:
        return _rebuild_winner(config, model, example_batch, schedule_steps, reused, saved.path)

    table: List[Dict[str, object]] = [_row(strategy, mesh) for strategy, mesh in candidates]
    phase(f"[auto] searching {len(candidates)} candidates (strategy x mesh), budget {budget / 2**30:.1f} GiB/device")
    _ask_planner(config, model, example_batch, candidates, budget, table)
    engines = _build_abstract(config, model, example_batch, schedule_steps, budget, table)
    _compile_together(engines, config.auto_compile_workers or len(engines))
    timed_bar = Progress("auto search: timing", max(len(engines), 1), unit="candidate")
    for row, engine in engines:
        peak = row["peak_bytes_per_device"]
        row["fits"] = peak is None or peak <= budget
        if not row["fits"]:
            row["note"] = f"needs {peak} B per device, budget {budget} B"
            timed_bar.update(1, candidate=_name(row), result="does not fit")
            continue
        row["step_time_s"] = _time_steps(engine, config, batches)
        timed_bar.update(1, candidate=_name(row), step_ms=round(row["step_time_s"] * 1e3, 2))
    timed_bar.close()
    best, best_time = _fastest([(row, engine) for row, engine in engines if row["fits"]])
    if best is None:
        raise KitError("--strategy auto: no candidate fits (see the notes above); lower --batch-size or the "
                       "model size, or raise --memory-limit-gb")
    for row in table:
        row["chosen"] = row["strategy"] == best.strategy and tuple(row["mesh_shape"]) == tuple(best.mesh.devices.shape)
    timed = sorted((r for r in table if r["step_time_s"]), key=lambda r: r["step_time_s"])
    runner_up = (f"; next {timed[1]['strategy']} {tuple(timed[1]['mesh_shape'])} at "
                 f"{timed[1]['step_time_s'] * 1e3:.2f} ms") if len(timed) > 1 else ""
    phase(f"[auto] chose {best.strategy} on mesh {tuple(best.mesh.devices.shape)}: fastest step "
          f"({best_time * 1e3:.2f} ms) of the {len(timed)} candidate(s) that fit, out of {len(table)}{runner_up}")
    if saved is not None:
        best.keep_step()
        saved.save(table)
    return best, table


def _fastest(timed: List[Tuple[dict, JaxEngine]]) -> Tuple[Optional[JaxEngine], float]:
    """The fastest candidate by process 0's times, on every process: each process's own clock differs
    a little, and processes that chose different winners would run different programs and hang."""
    times = [row["step_time_s"] for row, _ in timed]
    if jax.process_count() > 1 and times:
        from jax.experimental import multihost_utils

        times = [float(t) for t in multihost_utils.broadcast_one_to_all(np.asarray(times, np.float32))]
    for (row, _), agreed in zip(timed, times):
        row["step_time_s"] = agreed
    if not timed:
        return None, float("inf")
    best = min(range(len(timed)), key=times.__getitem__)
    return timed[best][1], times[best]


def _row(strategy: str, mesh: Tuple[int, int]) -> Dict[str, object]:
    return {"strategy": strategy, "mesh_shape": list(mesh), "fits": None, "peak_bytes_per_device": None,
            "compile_s": None, "step_time_s": None, "chosen": False, "note": ""}


def _name(row: Dict[str, object]) -> str:
    return f"{row['strategy']}{tuple(row['mesh_shape'])}"


def _ask_planner(config, model, example_batch, candidates, budget: int, table: List[Dict[str, object]]) -> None:
    """Several processes (a real cluster): drop what the planner, compiling on CPU devices in a worker
    process, predicts cannot fit or is far slower, before the GPUs compile anything. One process
    skips it: its candidates compile together in about the time the planner would take."""
    if jax.process_count() == 1 or jax.devices()[0].platform == "cpu":
        return
    from alpa_job.planner import gpus
    from alpa_job.planner.prefilter import drop_candidates

    gpu = gpus.DEVICE_KINDS.get(jax.devices()[0].device_kind)
    if gpu is None:
        phase(f"[auto] planner skipped: it has no figures for {jax.devices()[0].device_kind}")
        return
    try:
        _, dropped = drop_candidates(config, model, example_batch, candidates, budget, jax.process_count(),
                                     jax.local_device_count(), gpu)
    except Exception as err:  # noqa: BLE001 - the planner only narrows the search; without it all are compiled
        phase(f"[auto] planner skipped ({type(err).__name__}: {err}); compiling every candidate")
        return
    for drop in dropped:
        for row in table:
            if row["strategy"] == drop["strategy"] and list(row["mesh_shape"]) == list(drop["mesh_shape"]):
                row["note"], row["fits"] = drop["note"], False


def _build_abstract(config, model, example_batch, schedule_steps, budget: int, table) -> List[Tuple[dict, JaxEngine]]:
    """Each remaining candidate's engine, built abstractly; one whose state alone exceeds the budget is
    dropped before compiling (its shardings already decide it)."""
    engines = []
    for row in table:
        if row["note"]:
            continue
        try:
            engine = JaxEngine(config, model, example_batch, row["strategy"], tuple(row["mesh_shape"]),
                               schedule_steps=schedule_steps)
        except KitError as err:
            row["note"] = str(err)
            continue
        state = memory_fit.state_bytes_per_device(engine.abstract_state)
        if state > budget:
            row["fits"], row["note"] = False, f"its state alone needs {state} B per device, budget {budget} B"
            continue
        engines.append((row, engine))
    return engines


def compile_schedule(engines: list, workers: int, platform: str) -> List[Tuple[list, int]]:
    """[(candidates, how many compile at once)] in order. On GPUs the first compiles alone: XLA autotunes
    each new kernel shape on the devices, and cold compiles autotuning together slowed each other far
    past one after another; once the first's results are in the process, the rest (sharing most
    kernel shapes, or autotuning only their own) compile together, outside the GIL."""
    if platform == "cpu" or len(engines) < 2 or workers < 2:
        return [(engines, workers)]
    return [(engines[:1], 1), (engines[1:], workers)]


def _compile_together(engines: List[Tuple[dict, JaxEngine]], workers: int) -> None:
    """Compile the candidates' steps in compile_schedule's order; a failure becomes that candidate's note."""
    bar = Progress("auto search: compiling", max(len(engines), 1), unit="candidate")
    schedule = compile_schedule(engines, workers, jax.devices()[0].platform)
    for index, (group, at_once) in enumerate(schedule):
        with concurrent.futures.ThreadPoolExecutor(max(at_once, 1), thread_name_prefix="auto-compile") as pool:
            futures = {pool.submit(engine.compile_step): (row, engine) for row, engine in group if not row["note"]}
            if index + 1 < len(schedule):  # lowering (Python) overlaps this group's XLA compiles
                _lower_ahead(schedule[index + 1][0])
            for future in concurrent.futures.as_completed(futures):
                row, engine = futures[future]
                try:
                    stats = future.result()
                except KitError as err:
                    row["note"] = str(err)
                    bar.update(1, candidate=_name(row), result="failed")
                    continue
                # Compiled concurrently, so each one's wall time overlaps the others'.
                row["compile_s"] = round(stats.compile_seconds, 3)
                row["peak_bytes_per_device"] = (stats.memory or {}).get("peak_estimate_bytes")
                bar.update(1, candidate=_name(row), compile_s=row["compile_s"])
    bar.close()
    engines[:] = [(row, engine) for row, engine in engines if not row["note"]]


def _lower_ahead(group: List[Tuple[dict, JaxEngine]]) -> None:
    for row, engine in group:
        try:
            engine.lower_step()
        except KitError as err:
            row["note"] = str(err)


def _time_steps(engine: JaxEngine, config, batches) -> float:
    """Median wall time of `auto_trial_steps` steps after one warm-up step."""
    state = engine.init_state(config.seed)
    device_batches = [engine.put_batch(b) for b in batches]
    state, loss = engine.step(state, device_batches[0])
    jax.block_until_ready(loss)
    times = []
    for i in range(config.auto_trial_steps):
        start = time.perf_counter()
        state, loss = engine.step(state, device_batches[i % len(device_batches)])
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    times.sort()
    del state
    return times[len(times) // 2]


def _rebuild_winner(config, model, example_batch, schedule_steps, table, path: str):
    row = next(r for r in table if r.get("chosen"))
    phase(f"[auto] reusing the search in {path}: {row['strategy']} on mesh {tuple(row['mesh_shape'])} "
          "(delete the file to search again)")
    engine = JaxEngine(config, model, example_batch, row["strategy"], tuple(row["mesh_shape"]),
                       schedule_steps=schedule_steps)
    engine.compile()
    for r in table:
        r["note"] = (r.get("note") or "") + (" " if r.get("note") else "") + "(from the saved search)"
    return engine, table


class SavedSearch:
    """A search's table beside the compile cache, keyed by everything the steps depend on (the step
    store's key with the strategy 'auto') plus the candidates and the memory budget."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def open(cls, config, schedule_steps, candidates, example_batch, budget: int) -> Optional["SavedSearch"]:
        directory = compile_cache.resolve(getattr(config, "compile_cache", None))
        if directory is None:
            return None
        example = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in example_batch.items()}
        key = step_key(config, schedule_steps, "auto", make_mesh(candidates[0][1]), example)
        key.update(candidates=[[s, list(m)] for s, m in candidates], budget=budget,
                   trial_steps=config.auto_trial_steps)
        return cls(os.path.join(directory, SEARCH_DIR, key_digest(key) + ".json"))

    def load(self) -> Optional[List[Dict[str, Any]]]:
        try:
            with open(self.path) as f:
                table = json.load(f)["table"]
        except (OSError, ValueError, KeyError):
            return None
        return table if any(r.get("chosen") for r in table) else None

    def save(self, table: List[Dict[str, Any]]) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"table": table}, f, indent=1, default=str)
        os.replace(tmp, self.path)  # whole or absent: a crash mid-write never leaves half a search
