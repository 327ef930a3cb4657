"""Where the kit's extra scratch comes from: XLA's memory analysis of the kit's and the peer's GPT step,
each compiled with and without donating its state (compile only: no state is allocated).

    python3 bench/gpu_scratch.py --case gpt24
"""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

import lib.checkout  # noqa: F401 - first: alpa_job from this checkout

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

import gpu_peer
from gpu_common import gpt_case
from lib.results import save_result
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.record.jax_program import memory_analysis


def kit(config, model, batch, donate: bool):
    engine = JaxEngine(config, model, batch, "data", (1, 1))
    if donate:  # the engine's own step, as it compiles it
        return engine.compile_step().memory
    abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=engine.batch_sharding) for k, v in engine._example.items()}
    jitted = jax.jit(
        engine._train_step,
        in_shardings=(engine.state_sharding, engine.batch_sharding),
        out_shardings=(engine.state_sharding, NamedSharding(engine.mesh, PartitionSpec())),
    )
    return memory_analysis(jitted.lower(engine.abstract_state, abstract_batch).compile())


def peer(config, model, batch, donate: bool):
    m = SimpleNamespace(**config.model_args)
    params = jax.eval_shape(
        lambda: gpu_peer.init_params(jax.random.PRNGKey(0), m.num_layers, m.d_model, m.vocab_size, m.seq_len, m.num_heads)
    )
    tx = optax.adam(1e-4)
    opt_state = jax.eval_shape(tx.init, params)
    jitted = jax.jit(gpu_peer.train_step(tx, m.num_heads), donate_argnums=(0, 1) if donate else ())
    tokens = jax.ShapeDtypeStruct(batch["tokens"].shape, jnp.int32)
    return memory_analysis(jitted.lower(params, opt_state, tokens).compile())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="gpt24")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    config, model, batch = gpt_case(args.case, compile_cache="none")
    rows = []
    for name, fn in (
        ("kit, donated (the engine)", kit),
        ("kit, not donated", kit),
        ("peer, not donated (the peer)", peer),
        ("peer, donated", peer),
    ):
        mem = fn(config, model, batch, donate="not" not in name)
        row = {"loop": name, **{k: round(v / 1e9, 2) for k, v in mem.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    save_result("gpu_scratch", args.out, {"case": args.case, "rows": rows})
    print("| loop | arguments GB | outputs GB | aliased GB | temp GB | peak estimate GB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['loop']} | {r['argument_size_in_bytes']} | {r['output_size_in_bytes']} | "
            f"{r['alias_size_in_bytes']} | {r['temp_size_in_bytes']} | {r['peak_estimate_bytes']} |"
        )


if __name__ == "__main__":
    main()
