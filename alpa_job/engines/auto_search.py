"""`--strategy auto`: an honest small version of Alpa's profile-guided search.

Every candidate strategy x mesh shape is built abstractly first (no compile): one whose state alone
exceeds a device's budget is dropped there, and on a cluster of several processes the planner
(alpa_job.planner) drops those it predicts cannot fit or are far slower than the best. The rest are
ranked one of two ways. Whole (the default): the candidates compile together, XLA compiling outside
the GIL (on GPUs after the first alone: compile_schedule), and those whose XLA memory estimate fits
are timed over a few real steps. Or on shallow copies of the model (shallow_ranking, for a model
that declares its depth): each candidate's copies compile and run, the whole model's step time and
memory are predicted from them, and only the predicted winner compiles whole. The fastest wins. The
table of every candidate goes in the report, and the result is kept beside the compile cache, so a
second identical run trains its winner straight away.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import numpy as np

from alpa_job import strategies
from alpa_job.engines import compile_cache, every_process, shallow_ranking
from alpa_job.engines.executable_store import key_digest, step_key
from alpa_job.engines.jax_engine import JaxEngine, make_mesh
from alpa_job.errors import KitError
from alpa_job.progress.events import Progress, phase, timed

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


# prefilter(candidates, budget bytes) -> the candidates to drop ({"strategy", "mesh_shape", "note"}): the
# planner's prediction (planner.prefilter.for_auto), handed in by the caller, since the planner compiles
# its candidates with this engine.
Prefilter = Callable[[List[Tuple[str, Tuple[int, int]]], int], List[Dict[str, Any]]]


def search(
    config, model, example_batch, batches, schedule_steps: Optional[int] = None, prefilter: Optional[Prefilter] = None
) -> Tuple[JaxEngine, List[Dict[str, object]]]:
    """Return the fastest fitting engine (compiled) and the table of every candidate.
    `schedule_steps`: the learning-rate schedule's horizon (JaxEngine)."""
    budget = device_memory_budget(config.memory_limit_gb)
    candidates = strategies.auto_candidates(len(jax.devices()), jax.local_device_count())
    saved = SavedSearch.open(config, schedule_steps, candidates, example_batch, budget)
    reused = _reused_everywhere(candidates, saved.load() if saved is not None else None)
    if reused is not None:
        return _rebuild_winner(config, model, example_batch, schedule_steps, reused, saved.path)

    table: List[Dict[str, object]] = [_row(strategy, mesh) for strategy, mesh in candidates]
    phase(f"[auto] searching {len(candidates)} candidates (strategy x mesh), budget {budget / 2**30:.1f} GiB/device")
    if prefilter is not None:
        _ask_planner(prefilter, candidates, budget, table)
    engines = _build_abstract(config, model, example_batch, schedule_steps, budget, table)
    copies = shallow_ranking.copies_for(config, model)
    started = time.perf_counter()
    memory_decided = False  # shallow_ranking.least_memory_among_ties chose over the fastest prediction
    if copies is None:
        _compile_together(engines, config.auto_compile_workers or len(engines))
        every_process.wait("alpa_job_auto_candidates_compiled")
        _time_whole(engines, config, batches, budget)
        ranked = _ranked([(row, engine) for row, engine in engines if row["fits"]])
        best = ranked[0][1] if ranked else None
    else:
        phase(
            f"[auto] timing each candidate on copies of the model with "
            f"{' and '.join(map(str, shallow_ranking.DEPTHS))} of its {copies.full_depth} layers"
        )
        predicted, background = _rank_on_copies(config, copies, engines, example_batch, schedule_steps, budget, batches)
        fastest_first = _ranked(predicted)
        # Every process decides on process 0's peaks, as on its times: a different winner would hang the run.
        peaks = _agreed(
            [float("inf") if row["peak_bytes_per_device"] is None else float(row["peak_bytes_per_device"]) for row, _ in fastest_first]
        )
        ranked = shallow_ranking.least_memory_among_ties(fastest_first, peaks)
        memory_decided = bool(ranked) and ranked[0] is not fastest_first[0]
        if memory_decided:
            ranked[0][0]["note"] += (
                f"; chosen over the fastest prediction ({_name(fastest_first[0][0])}, within "
                f"{shallow_ranking.TIE:.0%}): it needs less memory"
            )
        ranking_s = time.perf_counter() - started
        best = _compile_whole_winner(ranked, budget, background)
        if best is not None:
            best.stats.setup_phases["auto_ranking_on_copies"] = ranking_s
    if best is None:
        raise KitError(
            "--strategy auto: no candidate fits (see the notes above); lower --batch-size or the model size, or raise --memory-limit-gb"
        )
    best_time = next(row["step_time_s"] for row, engine in ranked if engine is best)
    best.stats.setup_phases["auto_search"] = time.perf_counter() - started
    for row in table:
        row["chosen"] = row["strategy"] == best.strategy and tuple(row["mesh_shape"]) == tuple(best.mesh.devices.shape)
    by_time = sorted((r for r in table if r["step_time_s"]), key=lambda r: r["step_time_s"])
    how = "predicted " if copies is not None else ""
    why = f"fastest {how}step ({best_time * 1e3:.2f} ms)"
    if memory_decided:
        why = f"the least memory of the {how}steps within {shallow_ranking.TIE:.0%} of the fastest ({best_time * 1e3:.2f} ms)"
    others = [r for r in by_time if not r["chosen"]]
    runner_up = (
        (
            f"; {'fastest' if memory_decided else 'next'} {others[0]['strategy']} "
            f"{tuple(others[0]['mesh_shape'])} at {others[0]['step_time_s'] * 1e3:.2f} ms"
        )
        if others
        else ""
    )
    phase(
        f"[auto] chose {best.strategy} on mesh {tuple(best.mesh.devices.shape)}: {why} of the {len(by_time)} "
        f"candidate(s) that fit, out of {len(table)}{runner_up}"
    )
    if saved is not None:
        best.keep_step()
        saved.save(table)
    return best, table


def _time_whole(engines: List[Tuple[dict, JaxEngine]], config, batches, budget: int) -> None:
    """Each compiled candidate whose XLA memory estimate fits, timed over a few real steps."""
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


def _rank_on_copies(
    config, copies: shallow_ranking.Copies, engines: List[Tuple[dict, JaxEngine]], example_batch, schedule_steps, budget: int, batches
) -> Tuple[List[Tuple[dict, JaxEngine]], Optional[WholeCompile]]:
    """Compile and time each candidate's shallow copies; its row gets the whole model's predicted step time
    and peak. Returns the candidates predicted to fit, with their whole-model engines, and the whole compile
    of the likeliest winner (_likeliest_first), started in the background once its first copy compiled."""
    # Per candidate, its copies as (row, engine) pairs in DEPTHS order: the rows are _compile_together's.
    groups: List[Tuple[dict, JaxEngine, List[Tuple[dict, JaxEngine]]]] = []
    for row, engine in _likeliest_first(engines):
        if engine.pipeline is not None:
            # Each stage holds whole blocks, so a copy would need a multiple of the stages in layers; the
            # copies' depths are fixed for every candidate alike, so a pipeline is ranked whole only.
            row["note"] = f"not ranked on copies: a pipeline of {row['mesh_shape'][0]} stages is timed only whole (--auto-rank-on whole)"
            continue
        try:
            shallow = shallow_ranking.copy_engines(copies, row["strategy"], tuple(row["mesh_shape"]), example_batch, schedule_steps)
        except KitError as err:
            row["note"] = str(err)
            continue
        groups.append((row, engine, [(_row(row["strategy"], tuple(row["mesh_shape"])), copy) for copy in shallow]))
    deeper = [group[-1] for _, _, group in groups]
    shallower = [group[0] for _, _, group in groups]
    workers = config.auto_compile_workers or 2 * len(groups)
    # The whole candidates lower (Python, under the GIL) on a thread while the copies' XLA compiles run, so
    # a whole compile only compiles; the likeliest first, as its compile starts soonest.
    lowering = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="auto-lower")
    likeliest_lowered = lowering.submit(_lower_ahead, [(row, engine) for row, engine, _ in groups[:1]])
    lowered = lowering.submit(_lower_ahead, [(row, engine) for row, engine, _ in groups[1:]])
    lowering.shutdown(wait=False)
    # One initialiser in all, the likeliest's deeper copy's: every copy's state is its state, resharded and cut
    # (state_like). It is created whole on every device so that every candidate's layout is a slice of it (no
    # candidate's own layout is whole: data splits its optimizer state); resharding from a split layout hung
    # multi-process CPU devices.
    for _, copy in deeper:
        copy.initialise_replicated = True
    source = deeper[0] if deeper else None
    background: Optional[WholeCompile] = None

    def start_likeliest() -> None:
        # Once the likeliest's first copy autotuned its kernels (which its whole model shares), it compiles
        # whole beside the other copies: when it wins, it is ready about when the ranking ends.
        nonlocal background
        if groups and not groups[0][0]["note"] and not groups[0][2][-1][0]["note"]:
            background = WholeCompile(groups[0][1], after=likeliest_lowered)

    _compile_together(
        list(deeper),
        workers,
        compile_schedule(deeper, workers, jax.devices()[0].platform),
        initialised={id(source[1])} if source else set(),
        after_first=start_likeliest,
    )
    lowered.result()  # done before any copy is timed: lowering would take the GIL from the timed steps
    likeliest_lowered.result()
    every_process.wait("alpa_job_auto_deeper_copies_compiled")  # their first programs spanning processes follow
    template = next((copy.init_state(config.seed) for part, copy in deeper if not part["note"]), None)
    times = _time_copies([p for p in deeper if not p[0]["note"]], shallow_ranking.DEPTHS[-1], template, config, batches, budget)
    _compile_together(list(shallower), workers, [(shallower, workers)], initialised=set())
    every_process.wait("alpa_job_auto_shallower_copies_compiled")
    times.update(_time_copies([p for p in shallower if not p[0]["note"]], shallow_ranking.DEPTHS[0], template, config, batches, budget))
    del template
    fitting = []
    for row, engine, group in groups:
        failed = next((part["note"] for part, _ in group if part["note"]), "")
        measured = [times.get(id(part)) for part, _ in group]
        if failed or None in measured:
            row["note"] = failed or "a copy was not timed (it does not fit)"
            continue
        row["compile_s"] = round(sum(part["compile_s"] for part, _ in group), 3)
        row["predicted_from"] = list(shallow_ranking.DEPTHS)
        peaks = [part["peak_bytes_per_device"] for part, _ in group]
        row["peak_bytes_per_device"] = None if None in peaks else int(shallow_ranking.extrapolate(peaks, copies.full_depth))
        peak = row["peak_bytes_per_device"]
        row["fits"] = peak is None or peak <= budget
        if not row["fits"]:
            row["note"] = f"{copies.note()}: needs {peak} B per device, budget {budget} B"
            continue
        row["copy_step_time_s"] = measured
        row["step_time_s"], disturbed = shallow_ranking.predict_step_time(measured, copies.full_depth)
        row["note"] = copies.note() + (f"; {disturbed}" if disturbed else "")
        fitting.append((row, engine))
    return fitting, background


def _likeliest_first(engines: List[Tuple[dict, JaxEngine]]) -> List[Tuple[dict, JaxEngine]]:
    """The candidates, the likeliest winner first, guessed from shardings alone before anything compiles:
    the least state per device, then the fewest devices on the model axis. Splitting the state over the
    data axis (fsdp) moves the gradients' bytes that replicating it does, and each device updates only its
    share; a model axis narrows every matmul and puts its all-reduces on the forward's critical path. A
    wrong guess costs time only (one more whole compile): the copies still rank."""
    # A stable sort: equal guesses keep the candidates' order.
    return sorted(engines, key=lambda pair: (pair[1].state_bytes_per_device, pair[1].mesh.devices.shape[1]))


def _time_copies(parts: List[Tuple[dict, JaxEngine]], depth: int, template, config, batches, budget: int) -> Dict[int, float]:
    """{id(copy's row): its step time} for the copies (of `depth` layers) whose XLA memory estimate fits,
    timed together, each from `template` (shallow_ranking.time_interleaved)."""
    fitting = [(p, c) for p, c in parts if p["peak_bytes_per_device"] is None or p["peak_bytes_per_device"] <= budget]
    if not fitting or template is None:
        return {}
    bar = Progress("auto search: timing copies", 1, unit="depth")
    times = _agreed(shallow_ranking.time_interleaved([c for _, c in fitting], template, config.seed, batches, config.auto_trial_steps))
    bar.update(1, depth=depth, step_ms=" ".join(f"{t * 1e3:.2f}" for t in times))
    bar.close()
    return {id(p): t for (p, _), t in zip(fitting, times)}


class WholeCompile:
    """A whole candidate's compile (its initialiser's beside it) on a thread, outside the GIL, once `after`
    (its lowering ahead) is done: a step lowers and compiles on one thread at a time."""

    def __init__(self, engine: JaxEngine, after: Optional[concurrent.futures.Future] = None):
        self.engine = engine
        phase(
            f"[auto] compiling {engine.strategy} on mesh {tuple(engine.mesh.devices.shape)} whole in the "
            "background, the likeliest winner, while the copies rank"
        )

        def compile_after():
            if after is not None:
                after.result()
            return engine.compile()

        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="auto-whole")
        self.future = pool.submit(compile_after)
        pool.shutdown(wait=False)


def _compile_whole_winner(
    ranked: List[Tuple[dict, JaxEngine]], budget: int, background: Optional[WholeCompile] = None
) -> Optional[JaxEngine]:
    """The fastest predicted candidate compiled whole (the step store keeps it, as a fixed run's), or the
    background compile when it is that one; one whose whole step turns out not to fit gives way to the next."""
    for row, engine in ranked:
        try:
            with timed(f"compiling train step ({engine.strategy}, mesh {engine.mesh.devices.shape}, the predicted fastest)"):
                stats = background.future.result() if background is not None and background.engine is engine else engine.compile()
        except KitError as err:
            row["fits"], row["note"] = False, f"{row['note']}; compiled whole: {err}"
            continue
        peak = (stats.memory or {}).get("peak_estimate_bytes")
        row["whole_compile_s"] = round(stats.compile_seconds, 3)
        if peak is not None and peak > budget:
            row["fits"], row["note"] = False, f"{row['note']}; compiled whole it needs {peak} B, budget {budget} B"
            continue
        return engine  # its row keeps the predicted peak: the report's memory section has the whole step's
    return None


def _agreed(times: List[float]) -> List[float]:
    """Process 0's figures (step times, peaks), on every process: each process's own clock differs a little,
    and processes that chose different winners would run different programs and hang."""
    if jax.process_count() > 1 and times:
        from jax.experimental import multihost_utils

        return [float(t) for t in multihost_utils.broadcast_one_to_all(np.asarray(times, np.float32))]
    return list(times)


def _ranked(timed: List[Tuple[dict, JaxEngine]]) -> List[Tuple[dict, JaxEngine]]:
    """The candidates fastest first, by process 0's times on every process (_agreed)."""
    for (row, _), agreed in zip(timed, _agreed([row["step_time_s"] for row, _ in timed])):
        row["step_time_s"] = agreed
    return sorted(timed, key=lambda pair: pair[0]["step_time_s"])


def _row(strategy: str, mesh: Tuple[int, int]) -> Dict[str, object]:
    return {
        "strategy": strategy,
        "mesh_shape": list(mesh),
        "fits": None,
        "peak_bytes_per_device": None,
        "compile_s": None,
        "step_time_s": None,
        "chosen": False,
        "note": "",
        "predicted_from": None,
    }


def _name(row: Dict[str, object]) -> str:
    return f"{row['strategy']}{tuple(row['mesh_shape'])}"


def _ask_planner(prefilter: Prefilter, candidates, budget: int, table: List[Dict[str, object]]) -> None:
    """Several processes (a real cluster): drop what the planner, compiling on CPU devices in a worker
    process, predicts cannot fit or is far slower, before the GPUs compile anything. One process
    skips it: its candidates compile together in about the time the planner would take."""
    if jax.process_count() == 1 or jax.devices()[0].platform == "cpu":
        return
    try:
        dropped = prefilter(candidates, budget)
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
            engine = JaxEngine(config, model, example_batch, row["strategy"], tuple(row["mesh_shape"]), schedule_steps=schedule_steps)
        except KitError as err:
            row["note"] = str(err)
            continue
        state = engine.state_bytes_per_device
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


def _compile_together(
    engines: List[Tuple[dict, JaxEngine]],
    workers: int,
    schedule: Optional[List[Tuple[list, int]]] = None,
    initialised: Optional[set] = None,
    after_first: Optional[Callable[[], None]] = None,
) -> None:
    """Compile the candidates' steps in `schedule`'s order (default: compile_schedule's); a failure becomes
    that candidate's note. `initialised`: ids of the only engines whose initialiser compiles (default: all).
    `after_first`: called once the schedule's first group has compiled."""
    bar = Progress("auto search: compiling", max(len(engines), 1), unit="candidate")
    schedule = schedule or compile_schedule(engines, workers, jax.devices()[0].platform)
    for index, (group, at_once) in enumerate(schedule):
        with concurrent.futures.ThreadPoolExecutor(max(at_once, 1), thread_name_prefix="auto-compile") as pool:
            futures = {
                pool.submit(engine.compile_step, initialised is None or id(engine) in initialised): (row, engine)
                for row, engine in group
                if not row["note"]
            }
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
        if index == 0 and after_first is not None:
            after_first()
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


def _reused_everywhere(candidates, reused: Optional[List[Dict[str, Any]]]) -> Optional[List[Dict[str, Any]]]:
    """A saved search is reused on every process of a job or on none. Each node may keep its own cache (the
    default), so a job placed on a node that never ran it, or on a replaced one, finds the table on some
    processes only: one that searched while the others rebuilt the winner would run other programs than
    theirs and hang them. Reused only where every process saved the same winner."""
    if jax.process_count() == 1:
        return reused
    from jax.experimental import multihost_utils

    mine = _chosen_index(candidates, reused)
    every_process.wait("auto-saved-search")  # the first collective's rendezvous: every process at once
    winners = [int(i) for i in np.ravel(multihost_utils.process_allgather(np.asarray(mine, np.int32)))]
    if agreed_winner(winners) is None:
        if mine >= 0 or any(i >= 0 for i in winners):
            missing = [p for p, i in enumerate(winners) if i < 0]
            phase(
                f"[auto] the saved search is not the same on every process (process(es) {missing} have none, "
                f"winners {sorted({i for i in winners if i >= 0})} elsewhere): searching again on all"
            )
        return None
    return reused


def agreed_winner(winners: List[int]) -> Optional[int]:
    """The candidate every process's saved search chose (its index), or None unless all saved the same one."""
    return winners[0] if winners and winners[0] >= 0 and all(i == winners[0] for i in winners) else None


def _chosen_index(candidates, table: Optional[List[Dict[str, Any]]]) -> int:
    """Where the saved table's winner is in `candidates`; -1 for no table (or a winner no longer among them)."""
    row = next((r for r in table or [] if r.get("chosen")), None)
    if row is None:
        return -1
    wanted = (row["strategy"], tuple(row["mesh_shape"]))
    return next((i for i, (strategy, mesh) in enumerate(candidates) if (strategy, tuple(mesh)) == wanted), -1)


def _rebuild_winner(config, model, example_batch, schedule_steps, table, path: str):
    row = next(r for r in table if r.get("chosen"))
    phase(f"[auto] reusing the search in {path}: {row['strategy']} on mesh {tuple(row['mesh_shape'])} (delete the file to search again)")
    engine = JaxEngine(config, model, example_batch, row["strategy"], tuple(row["mesh_shape"]), schedule_steps=schedule_steps)
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
        key.update(
            candidates=[[s, list(m)] for s, m in candidates],
            budget=budget,
            trial_steps=config.auto_trial_steps,
            rank_on=getattr(config, "auto_rank_on", "copies"),
        )
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
