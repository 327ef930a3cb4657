"""The kit's JAX engine against a competent hand-written loop, same process, one GPU (issue 16).

The peer (bench/gpu_peer.py) is what a user who knows JAX writes: plain jax.jit, optax Adam,
cuDNN flash attention, bf16 compute including the tied output projection, fp32 parameters, and
the same architecture and parameter count as the kit's GPT. The kit is JaxEngine over
alpa_job.models.gpt (AOT compile, donated state) exactly as the CLI builds it. The two loops run
alternately, `--repeats` rounds of `--steps` steps each, every loop's state parked in host memory
while the other runs (bench/gpu_common.py says why); the table shows the medians.

Extras, labelled as such: `einsum`, the textbook plain loop the first version of this bench
compared with (the kit's own module with einsum attention, jax.jit, no donation) - not a peer a
user would pick.

    python3 bench/gpu_engine_vs_jit.py --out bench/results      # on the GPU machine, no Ray needed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import lib.checkout  # noqa: F401 - first: alpa_job from this checkout

import jax
import jax.numpy as jnp
import optax

import gpu_peer
from types import SimpleNamespace
from gpu_common import GPT_CASES, PEAK_TFLOPS_H100, Loop, alternate, gpt_case, gpt_flops, kit_loop, park, unpark
from lib.results import save_result

CASES = GPT_CASES
LABELS = {
    "gpt12": "GPT 12L d1024 h16 B16 S1024 V32768 bf16",
    "gpt24": "GPT 24L d2048 h16 B8 S1024 V32768 bf16",
    "tiny": "GPT 2L d64 (CPU smoke)",
}


def einsum_loop(config, model, batch):
    """The extra: the kit's module with textbook einsum attention in a plain jit loop (no donation)."""
    inner = model.module.module
    model = dataclasses.replace(model, module=type(model.module)(inner.clone(attention="einsum")))
    params = model.module.init(jax.random.PRNGKey(0), jnp.asarray(batch[model.input_key]))["params"]
    params = jax.tree_util.tree_map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))
    tx = optax.adam(config.learning_rate)

    @jax.jit
    def step(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(model.masked_loss, has_aux=True)(params, None, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return Loop("einsum", *gpu_peer.jit_run(step, params, tx.init(params), jax.device_put(batch)))


def trace_loops(loops, prefix: str, parked: bool) -> None:
    """3 steps of each loop under the profiler, one trace folder per loop (after the timing: not timed)."""
    for loop in loops:
        if parked:
            unpark(loop.holder, loop.sharding)
        loop.run(1)  # warm after the move
        jax.profiler.start_trace(f"{prefix}-{loop.name}", create_perfetto_trace=True)
        loop.run(3)
        jax.profiler.stop_trace()
        if parked:
            park(loop.holder)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="gpt12,gpt24")
    parser.add_argument("--extras", default="gpt12:einsum", help="CASE:einsum,... ('' for none)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS_H100, help="bf16 dense peak for MFU")
    parser.add_argument("--no-park", action="store_true", help="keep every loop's state on the device")
    parser.add_argument(
        "--trace",
        default=None,
        help="folder: a profiler trace of 3 steps of each loop, to compare their kernels (the trace of a loop lands in DIR/CASE-LOOP)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    extras = {e.split(":")[0]: e.split(":")[1] for e in args.extras.split(",") if e}
    device = jax.devices()[0].device_kind
    rows = []
    for name in args.cases.split(","):
        config, model, batch = gpt_case(name)
        m = SimpleNamespace(**config.model_args)
        t0 = time.perf_counter()
        peer_run, peer_holder, n_params, peer_compiled = gpu_peer.make_loop(
            m.num_layers, m.d_model, m.num_heads, m.vocab_size, m.seq_len, config.learning_rate, batch["tokens"]
        )
        peer = Loop("peer", peer_run, peer_holder)
        t1 = time.perf_counter()
        kit, engine = kit_loop(config, model, batch)
        t2 = time.perf_counter()
        n_kit = sum(x.size for x in jax.tree_util.tree_leaves(engine.abstract_state.params))
        assert n_kit == n_params, f"kit has {n_kit} parameters, the peer {n_params}: not the same model"
        loops = [peer, kit]
        if extras.get(name) == "einsum":
            loops.append(einsum_loop(config, model, batch))
        print(f"# {name}: peer built in {t1 - t0:.1f}s, kit compile+init {t2 - t1:.1f}s", flush=True)
        medians = alternate(loops, args.steps, args.repeats, parked=not args.no_park)
        if args.trace:
            trace_loops(loops, os.path.join(args.trace, name), parked=not args.no_park)
        flops = gpt_flops(n_params, config.batch_size, m.seq_len, m.num_layers, m.d_model)
        peer_mem = peer_compiled.memory_analysis()
        row = {
            "case": name,
            "label": LABELS[name],
            "params": n_params,
            "flops_per_step": flops,
            "peer_ms": round(medians["peer"] * 1e3, 2),
            "kit_ms": round(medians["kit"] * 1e3, 2),
            "kit_vs_peer": round(medians["peer"] / medians["kit"], 3),
            "peer_mfu": round(flops / medians["peer"] / 1e12 / args.peak_tflops, 3),
            "kit_mfu": round(flops / medians["kit"] / 1e12 / args.peak_tflops, 3),
            "kit_tflops": round(flops / medians["kit"] / 1e12, 1),
            "kit_temp_gb": round(engine.stats.memory["temp_size_in_bytes"] / 1e9, 2) if engine.stats.memory else None,
            "peer_temp_gb": round(peer_mem.temp_size_in_bytes / 1e9, 2) if peer_mem else None,
            "kit_compile_s": round(engine.stats.compile_seconds, 1),
            "samples_ms": {loop.name: [round(s * 1e3, 2) for s in loop.samples] for loop in loops},
        }
        if "einsum" in medians:
            row["extra_einsum_ms"] = round(medians["einsum"] * 1e3, 2)
            row["kit_vs_extra_einsum"] = round(medians["einsum"] / medians["kit"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del loops, peer, kit, engine, peer_run, peer_holder, peer_compiled
    save_result(
        "gpu_engine_vs_jit",
        args.out,
        {"steps": args.steps, "repeats": args.repeats, "parked": not args.no_park, "peak_tflops": args.peak_tflops, "rows": rows},
    )
    print(f"\n{device}, jax {jax.__version__}; median of {args.repeats} alternating rounds x {args.steps} steps")
    print("| case | competent loop ms (MFU) | kit ms (MFU) | kit / loop | kit temp GB | loop temp GB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['peer_ms']} ({r['peer_mfu']}) | {r['kit_ms']} ({r['kit_mfu']}) | "
            f"**{r['kit_vs_peer']}** | {r['kit_temp_gb']} | {r['peer_temp_gb']} |"
        )
    for r in rows:
        if "extra_einsum_ms" in r:
            print(
                f"extra (not a peer): {r['case']} textbook einsum-attention jit loop {r['extra_einsum_ms']} ms; "
                f"kit is {r['kit_vs_extra_einsum']}x that"
            )


if __name__ == "__main__":
    main()
