"""auto's candidates ranked on shallow copies of the model, so that only the winner compiles whole.

A model of N identical layers costs about t(1) + (N - 1) x (t(3) - t(1)) / 2 a step: every layer does
the same work and moves the same bytes, the rest (embeddings, head, optimizer over those) is paid once.
Its peak memory grows the same way. So each candidate is compiled and timed on copies of the model
with 1 and 3 layers, which compile in a fraction of the whole model's time, and the whole model's
step time and peak are predicted from the two. Only the predicted winner is then compiled whole: the
one compile a fixed strategy pays anyway. Alpa's own search profiles slices of a model's layers
instead of the whole model for the same reason.

A copy is the model rebuilt with its builder's `depth_setting` (api.Model) changed, so a model that
declares none, or one too shallow for copies to save time, is searched whole (auto_search).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, List, Optional, Sequence, Tuple

import jax

from alpa_job import models
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.progress.events import phase

DEPTHS = (1, 3)
# Below this depth, compiling two copies per candidate costs about as much as compiling it whole.
MIN_DEPTH = 2 * DEPTHS[-1]
STEPS_PER_ROUND = 5
# Copies see little of how a deep model's layers overlap each other's communication (nor what combining
# many layers' collectives into one saves), so their predictions miss the whole step by a few percent and
# candidates nearer than this can rank either way; among those, the least memory a device wins.
TIE = 0.03


@dataclasses.dataclass
class Copies:
    full_depth: int
    configs_and_models: List[Tuple[Any, Any]]  # (config, ModelSpec) for each of DEPTHS

    def note(self) -> str:
        return f"predicted for {self.full_depth} layers from copies with {' and '.join(map(str, DEPTHS))}"


def copies_for(config, model) -> Optional[Copies]:
    """The shallow copies to rank on (`--auto-rank-on copies`, the default), or None: the search then compiles
    and times candidates whole (`--auto-rank-on whole`, or a model copies cannot serve, which it is told)."""
    if getattr(config, "auto_rank_on", "copies") != "copies":
        return None
    full = models.depth_of(config, model)
    if full is None or full < MIN_DEPTH:
        why = (
            f"--model {config.model} declares no depth_setting (alpa_job.api.Model)"
            if full is None
            else f"its {full} layers are too few (copies pay off from {MIN_DEPTH})"
        )
        phase(f"[auto] ranking the candidates whole, not on copies: {why}")
        return None
    return Copies(full, [models.at_depth(config, model, depth) for depth in DEPTHS])


def extrapolate(values: Sequence[float], full_depth: int) -> float:
    """The whole model's figure from the copies' (one per DEPTHS), linear in the layer count."""
    (d1, v1), (d2, v2) = zip(DEPTHS, values)  # 1 and 3 layers apart: a timing error grows (N - 1) / 2-fold
    return v1 + (full_depth - d1) * (v2 - v1) / (d2 - d1)


def predict_step_time(measured: Sequence[float], full_depth: int) -> Tuple[float, str]:
    """The whole model's step time from its copies' (one per DEPTHS), and a note when the copies' times
    could not be extrapolated: a deeper copy that ran faster than a shallower one was disturbed (another
    program's burst on a busy machine), and a line through the two would predict less than nothing. The
    deeper copy's time per layer then stands for every layer: an overestimate (the embeddings and head
    counted once a layer), never below the deeper copy itself."""
    shallow, deep = measured
    if deep >= shallow:
        return extrapolate(measured, full_depth), ""
    return (
        deep * full_depth / DEPTHS[-1],
        f"the {DEPTHS[0]}-layer copy timed slower than the {DEPTHS[-1]}-layer one (a busy machine?), so the "
        f"{DEPTHS[-1]}-layer copy's time per layer is scaled to {full_depth}",
    )


def least_memory_among_ties(ranked: List[Tuple[dict, Any]], peaks: Optional[Sequence[float]] = None) -> List[Tuple[dict, Any]]:
    """`ranked` (auto's (row, engine) pairs, fastest predicted first) with the winner moved to the front:
    of the candidates predicted within TIE of the fastest, the one with the smallest predicted peak (the
    fastest of those among equal peaks). `peaks`: those peaks, one per pair, where every process must
    decide on the same figures (default: the rows')."""
    if not ranked:
        return ranked
    if peaks is None:
        peaks = [row["peak_bytes_per_device"] for row, _ in ranked]
    peak_of = {id(pair): float("inf") if peak is None else peak for pair, peak in zip(ranked, peaks)}
    fastest = ranked[0][0]["step_time_s"]
    ties = [pair for pair in ranked if pair[0]["step_time_s"] <= fastest * (1 + TIE)]
    winner = min(ties, key=lambda pair: peak_of[id(pair)])
    return [winner] + [pair for pair in ranked if pair is not winner]


def copy_engines(
    copies: Copies, strategy: str, mesh_shape: Tuple[int, int], example_batch, schedule_steps: Optional[int]
) -> List[JaxEngine]:
    return [
        JaxEngine(config, model, example_batch, strategy, mesh_shape, schedule_steps=schedule_steps)
        for config, model in copies.configs_and_models
    ]


def time_interleaved(engines: List[JaxEngine], template, seed: int, batches, rounds: int) -> List[float]:
    """Each engine's step time: its fastest of `rounds` turns of STEPS_PER_ROUND steps. The engines take
    turns, in a rotated order each round, and each turn starts with one untimed step: a drift of the
    devices' clocks then moves every engine alike, and switching programs costs no engine its time. The
    fastest turn, not the median: the likeliest winner's whole compile runs beside, and it only ever adds
    time, in bursts that can cover two turns of three.
    Every state is `template` (the deepest copy's initial state) resharded and cut to the engine's depth."""
    states = []
    for engine in engines:  # every state before any step: a step donates (deletes) the state it is given
        try:
            states.append(engine.state_like(template))
        except ValueError:  # a model whose shallower copy's names are not a subset of the deeper one's
            states.append(engine.init_state(seed))
    runs = [[engine, state, [engine.put_batch(b) for b in batches]] for engine, state in zip(engines, states)]
    states.clear()
    per_step: List[List[float]] = [[] for _ in engines]
    for round_index in range(rounds):
        for offset in range(len(runs)):
            index = (round_index + offset) % len(runs)
            engine, state, device_batches = runs[index]
            state, loss = engine.step(state, device_batches[0])
            jax.block_until_ready(loss)
            start = time.perf_counter()
            for i in range(STEPS_PER_ROUND):
                state, loss = engine.step(state, device_batches[i % len(device_batches)])
            jax.block_until_ready(loss)
            per_step[index].append((time.perf_counter() - start) / STEPS_PER_ROUND)
            runs[index][1] = state
    runs.clear()  # the copies' states go before the winner's is made
    return [min(times) for times in per_step]
