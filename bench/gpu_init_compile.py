"""Where a cold and a warm run's time to first step goes on one GPU, variant by variant (issue 16).

Each variant runs in a fresh process with no persistent compile cache (unless it is the cache's own
variant), builds the kit's JaxEngine for one GPT case as the CLI does, and times the phases it is
about: lowering and compiling the state initialiser, compiling the step, running both, and loading
executables a previous process stored. The parent prints a table and saves the raw rows.

    python3 bench/gpu_init_compile.py --case gpt24 --variants base,parts,stored,rbg,eager

The first campaign (bench/RESULTS.md) ran this script at commit 21577b1, when `blocks` was a prototype
of what `parts` is now and `parallel` tried XLA flags that jax 0.11.2 no longer knows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import lib.checkout  # noqa: F401 - first: alpa_job from this checkout
from lib.results import save_result


def _engine(case: str, compile_cache: str = "none", whole: bool = False):
    from gpu_common import gpt_case
    from alpa_job.engines.jax_engine import JaxEngine

    config, model, batch = gpt_case(case, compile_cache=compile_cache)
    if whole:
        model = dataclasses.replace(model, repeated_blocks=None)
    return JaxEngine(config, model, batch, "data", (1, 1)), batch


def _timed(row: dict, key: str, fn):
    start = time.perf_counter()
    out = fn()
    row[key] = round(time.perf_counter() - start, 3)
    return out


def _block_until_ready(tree):
    import jax

    jax.block_until_ready(tree)
    return tree


def _steps(row: dict, engine, state, batch, n: int = 10):
    import jax

    device_batch = engine.put_batch(batch)
    state, _ = _timed(row, "first_step_s", lambda: _block_until_ready(engine.step(state, device_batch)))
    for _ in range(3):
        state, loss = engine.step(state, device_batch)
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(n):
        state, loss = engine.step(state, device_batch)
    jax.block_until_ready(loss)
    row["step_ms"] = round((time.perf_counter() - start) / n * 1e3, 2)


def child(variant: str, case: str, scratch: str) -> dict:
    """base: the whole-model initialiser (the engine before initialising by parts); parts: the engine's
    initialiser now (engines/state_init.py); rbg / eager: the whole initialiser with rbg keys / op by op;
    store, jaxcache_warm, serialized_load: the step through JAX's cache vs a serialised executable."""
    import flax.linen as nn
    import jax

    row: dict = {"variant": variant}
    if variant == "rbg":
        jax.config.update("jax_default_prng_impl", "rbg")
    # JAX's own cache for the step (compile_step: no step store), as before the kit's store existed.
    cache = os.path.join(scratch, "jaxcache") if variant in ("store", "jaxcache_warm") else "none"
    engine, batch = _timed(row, "engine_s", lambda: _engine(case, cache, whole=variant != "parts"))
    initializer = engine._initializer
    if variant == "eager":
        _timed(row, "init_run_s", lambda: _block_until_ready(nn.meta.unbox(initializer._whole_boxed(0))))
        return row
    if variant == "serialized_load":
        return _serialized_load(row, engine, batch, scratch)
    _timed(row, "init_lower_s", lambda: initializer.lower(engine.abstract_state))
    _timed(row, "init_compile_s", initializer.compile)
    state = _timed(row, "init_run_s", lambda: _block_until_ready(initializer(0)))
    if variant in ("rbg", "parts"):
        return row
    stats = _timed(row, "step_lower_compile_s", engine.compile_step)
    row["step_compile_s"] = round(stats.compile_seconds, 3)
    if variant == "store":
        from jax.experimental import serialize_executable

        payload, _, _ = _timed(row, "serialize_s", lambda: serialize_executable.serialize(engine._compiled))
        with open(os.path.join(scratch, "step.bin"), "wb") as f:
            f.write(payload)
        row["serialized_mb"] = round(len(payload) / 1e6, 1)
    _steps(row, engine, state, batch)
    return row


def _serialized_load(row: dict, engine, batch, scratch: str) -> dict:
    """Load the step a previous process serialised: no tracing, no lowering, no cache lookup."""
    import jax
    from jax.experimental import serialize_executable

    with open(os.path.join(scratch, "step.bin"), "rb") as f:
        payload = f.read()
    abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    in_tree = jax.tree_util.tree_structure(((engine.abstract_state, abstract_batch), {}))
    out_tree = jax.tree_util.tree_structure((engine.abstract_state, 0.0))
    compiled = _timed(row, "deserialize_s", lambda: serialize_executable.deserialize_and_load(payload, in_tree, out_tree))
    initializer = engine._initializer

    def init():
        initializer.lower(engine.abstract_state)
        initializer.compile()
        return _block_until_ready(initializer(0))

    state = _timed(row, "init_lower_compile_run_s", init)
    device_batch = engine.put_batch(batch)
    _timed(row, "first_step_s", lambda: _block_until_ready(compiled(state, device_batch)))
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="gpt24")
    parser.add_argument("--variants", default="base,parts,stored,rbg,eager")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all variants together")
    parser.add_argument("--child", default=None)
    parser.add_argument("--scratch", default=None)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    if args.child:
        print("ROW " + json.dumps(child(args.child, args.case, args.scratch)), flush=True)
        return
    scratch = tempfile.mkdtemp(prefix="initbench-")
    plan = []
    for v in args.variants.split(","):
        plan += {"stored": ["store", "jaxcache_warm", "serialized_load"]}.get(v, [v])
    rows = []
    started = time.perf_counter()
    for variant in plan:
        left = args.budget - (time.perf_counter() - started)
        if left < 30:
            rows.append({"variant": variant, "error": "skipped: out of the call's time"})
            continue
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", variant, "--case", args.case, "--scratch", scratch],
                capture_output=True,
                text=True,
                timeout=left,
            )
            found = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
            row = json.loads(found[0]) if found else {"variant": variant, "error": proc.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            row = {"variant": variant, "error": f"did not finish in {left:.0f} s"}
        wall = round(time.perf_counter() - start, 1)
        row["process_wall_s"] = wall
        rows.append(row)
        print(json.dumps(row), flush=True)

    save_result("gpu_init_compile", args.out, {"case": args.case, "rows": rows})


if __name__ == "__main__":
    main()
