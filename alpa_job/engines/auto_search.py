"""`--strategy auto`: an honest small version of Alpa's profile-guided search.

Compile every candidate strategy x mesh shape, drop those whose XLA memory estimate does not fit
a device, time a few real steps of the rest, keep the fastest. The whole table goes in the report.
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

import jax

from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.engines.sharding_rules import auto_candidates
from alpa_job.errors import KitError
from alpa_job.progress import Progress, phase


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
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(len(jax.local_devices()), 1)


def search(config, model, example_batch, batches, schedule_steps: Optional[int] = None
           ) -> Tuple[JaxEngine, List[Dict[str, object]]]:
    """Return the fastest fitting engine (compiled) and the table of every candidate.
    `schedule_steps`: the learning-rate schedule's horizon (JaxEngine)."""
    budget = device_memory_budget(config.memory_limit_gb)
    candidates = auto_candidates(len(jax.devices()))
    table: List[Dict[str, object]] = []
    best: Optional[JaxEngine] = None
    best_time = float("inf")
    bar = Progress("auto search", len(candidates), unit="candidate")
    phase(f"[auto] searching {len(candidates)} candidates (strategy x mesh), budget {budget / 2**30:.1f} GiB/device")
    for number, (strategy, mesh_shape) in enumerate(candidates, 1):
        phase(f"[auto] candidate {number}/{len(candidates)}: {strategy} on mesh {mesh_shape}: "
              "compiling and timing ...")  # " ...": a spinner on a terminal until its result line
        row: Dict[str, object] = {"strategy": strategy, "mesh_shape": list(mesh_shape), "fits": None,
                                  "peak_bytes_per_device": None, "compile_s": None, "step_time_s": None,
                                  "chosen": False, "note": ""}
        table.append(row)
        try:
            engine = JaxEngine(config, model, example_batch, strategy, mesh_shape, schedule_steps=schedule_steps)
            stats = engine.compile_step()
        except KitError as err:
            row["note"] = str(err)
            bar.update(1, candidate=f"{strategy}{mesh_shape}", result="skipped")
            continue
        row["compile_s"] = round(stats.compile_seconds, 3)
        peak = (stats.memory or {}).get("peak_estimate_bytes")
        row["peak_bytes_per_device"] = peak
        row["fits"] = peak is None or peak <= budget
        if not row["fits"]:
            row["note"] = f"needs {peak} B per device, budget {budget} B"
            bar.update(1, candidate=f"{strategy}{mesh_shape}", result="does not fit")
            continue
        row["step_time_s"] = _time_steps(engine, config, batches)
        bar.update(1, candidate=f"{strategy}{mesh_shape}", step_ms=round(row["step_time_s"] * 1e3, 2))
        if row["step_time_s"] < best_time:
            best, best_time = engine, row["step_time_s"]
    bar.close()
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
    return best, table


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
    return times[len(times) // 2]
