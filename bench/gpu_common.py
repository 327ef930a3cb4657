"""What the GPU benches share: the kit's loop, parking a loop's state on the host, alternating timing.

Parking: GPT 24L's state (fp32 params + Adam moments, 15 GB) fits twice on an 80 GB H100, but not
with the un-donated peer's second copy and both steps' scratch beside it (the first ablation ran
out of memory). So each loop's state goes to host memory while the other loop runs, comes back
before its own turn, and one untimed step runs after the move, so no timed step pays for it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

import jax

import lib.checkout  # noqa: F401 - the functions below import alpa_job from this checkout

# The GPU bench's models (the sizes of issue 16 / shared notes gpu.md; the presets gpt-12l and gpt-24l
# are the same models for the CLI), one table for every GPU bench script.
GPT_CASES = {
    "gpt12": dict(num_layers=12, d_model=1024, num_heads=16, batch_size=16, seq_len=1024, vocab_size=32768),
    "gpt24": dict(num_layers=24, d_model=2048, num_heads=16, batch_size=8, seq_len=1024, vocab_size=32768),
    "tiny": dict(num_layers=2, d_model=64, num_heads=4, batch_size=2, seq_len=64, vocab_size=256),  # CPU smoke
}

MODEL_SIZES = ("num_layers", "d_model", "num_heads", "seq_len", "vocab_size", "remat")  # the rest is the job's


def gpt_case(name: str, **overrides):
    """(config, model, example batch) for GPT_CASES[name], as the CLI builds them (bf16, lr 1e-4)."""
    from alpa_job.settings.config import JobConfig
    from alpa_job.data import epoch_batches, synthetic
    from alpa_job.models import get_model

    from alpa_job.models import resolve

    fields = {"num_samples": GPT_CASES[name]["batch_size"], "learning_rate": 1e-4, **GPT_CASES[name], **overrides}
    sizes = {k: fields.pop(k) for k in list(fields) if k in MODEL_SIZES}
    config = resolve(JobConfig(model="gpt", dtype="bfloat16", address="none", model_args=sizes, **fields).validated())
    batch, _ = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))
    return config, get_model(config), batch


PEAK_TFLOPS_H100 = 798.0  # bf16 dense, measured with an 8192^3 matmul on the lent H100 (KINDS.md)


def gpt_flops(n_params: int, batch: int, seq: int, layers: int, d_model: int) -> float:
    """6 * params * tokens + 12 * layers * batch * seq^2 * d_model (attention, no causal discount)."""
    return 6.0 * n_params * batch * seq + 12.0 * layers * batch * seq**2 * d_model


def _move(tree, kind: str):
    """Copy every array of `tree` to memory `kind` ("pinned_host" or "device"), freeing the source."""

    def move(leaf):
        if not isinstance(leaf, jax.Array):
            return leaf
        moved = jax.device_put(leaf, leaf.sharding.with_memory_kind(kind))
        moved.block_until_ready()
        leaf.delete()
        return moved

    return jax.tree_util.tree_map(move, tree)


def park(holder: list, sharding=None) -> None:
    """Move holder[0] (a pytree of device arrays) to pinned host memory and free the device copies.

    Pinned host memory moves at PCIe speed (jax.device_get into numpy took minutes for GPT 24L's
    15 GB state and ran the first campaign out of time)."""
    try:
        holder[0] = _move(holder[0], "pinned_host")
    except Exception:  # noqa: BLE001 - no pinned host memory here: numpy on the host, slower
        tree = holder[0]
        holder[0] = jax.device_get(tree)
        for leaf in jax.tree_util.tree_leaves(tree):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()


def unpark(holder: list, sharding=None) -> None:
    if any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(holder[0])):
        holder[0] = _move(holder[0], "device")
    else:
        holder[0] = jax.device_put(holder[0], sharding) if sharding is not None else jax.device_put(holder[0])
        jax.block_until_ready(holder[0])


class Loop:
    """A named training loop: run(n) does n steps on its own state, held in holder[0]."""

    def __init__(self, name: str, run: Callable[[int], object], holder: list, sharding=None):
        self.name, self.run, self.holder, self.sharding = name, run, holder, sharding
        self.samples: List[float] = []

    def time(self, steps: int, parked: bool) -> float:
        if parked:
            unpark(self.holder, self.sharding)
        self.run(1)  # untimed: the first step after a move or a compile
        start = time.perf_counter()
        self.run(steps)
        seconds = (time.perf_counter() - start) / steps
        if parked:
            park(self.holder)
        self.samples.append(seconds)
        return seconds

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)


def alternate(loops: List[Loop], steps: int, repeats: int, parked: bool) -> Dict[str, float]:
    """Time the loops in turn, `repeats` rounds of `steps` steps; median seconds per step each."""
    if parked:
        for loop in loops:
            park(loop.holder)
    for _ in range(repeats):
        for loop in loops:
            loop.time(steps, parked)
    return {loop.name: loop.median_s for loop in loops}


def kit_loop(config, model, batch, engine_cls=None, compiler_options: Optional[dict] = None):
    """The kit's JaxEngine on one device: (Loop, engine)."""
    from alpa_job.engines.jax_engine import JaxEngine

    engine = (engine_cls or JaxEngine)(config, model, batch, "data", (1, 1))
    if compiler_options is not None:
        engine.compiler_options = compiler_options
    engine.compile()
    return engine_loop(engine, 0, batch), engine


def engine_loop(engine, seed: int, batch) -> Loop:
    """A compiled engine's steps on one fixed batch, as a Loop (state kept in its holder between rounds)."""
    holder = [engine.init_state(seed)]
    device_batch = engine.put_batch(batch)

    def run(n: int):
        state = holder[0]
        loss = None
        for _ in range(n):
            state, loss = engine.step(state, device_batch)
        jax.block_until_ready(loss)
        holder[0] = state
        return loss

    return Loop("kit", run, holder, engine.state_sharding)
