"""Where the kit's extra scratch comes from: XLA's memory analysis of the kit's and the peer's GPT step,
each compiled with and without donating its state (compile only: no state is allocated).

    python3 bench/gpu_scratch.py --case gpt24
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import gpu_peer  # noqa: E402
from gpu_common import GPT_CASES  # noqa: E402
from alpa_job.config import JobConfig  # noqa: E402
from alpa_job.data import epoch_batches, synthetic  # noqa: E402
from alpa_job.engines.jax_engine import JaxEngine, memory_analysis  # noqa: E402
from alpa_job.models import get_model  # noqa: E402


def kit(config, batch, donate: bool):
    engine = JaxEngine(config, get_model(config), batch, "data", (1, 1))
    abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=engine.batch_sharding)
                      for k, v in engine._example.items()}
    jitted = jax.jit(engine._train_step, in_shardings=(engine.state_sharding, engine.batch_sharding),
                     out_shardings=(engine.state_sharding, NamedSharding(engine.mesh, PartitionSpec())),
                     donate_argnums=(0,) if donate else ())
    return memory_analysis(jitted.lower(engine.abstract_state, abstract_batch).compile())


def peer(config, tokens, donate: bool):
    params = jax.eval_shape(lambda: gpu_peer.init_params(jax.random.PRNGKey(0), config.num_layers, config.d_model,
                                                         config.vocab_size, config.seq_len))
    tx = optax.adam(1e-4)
    opt_state = jax.eval_shape(tx.init, params)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(gpu_peer.loss_fn)(params, tokens, config.num_heads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    return memory_analysis(jitted.lower(params, opt_state, jax.ShapeDtypeStruct(tokens.shape, jnp.int32)).compile())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="gpt24")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    config = JobConfig(model="gpt", num_samples=GPT_CASES[args.case]["batch_size"], dtype="bfloat16", address="none",
                       learning_rate=1e-4, compile_cache="none", **GPT_CASES[args.case]).validated()
    batch, _ = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))
    rows = []
    for name, fn, data in (("kit, donated (the engine)", kit, batch), ("kit, not donated", kit, batch),
                           ("peer, not donated (the peer)", peer, batch["tokens"]), ("peer, donated", peer, batch["tokens"])):
        mem = fn(config, data, donate="not" not in name)
        row = {"loop": name, **{k: round(v / 1e9, 2) for k, v in mem.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_scratch-{stamp}.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "case": args.case, "rows": rows,
                   "command": "python3 bench/gpu_scratch.py " + " ".join(sys.argv[1:])}, f, indent=2)
    print("| loop | arguments GB | outputs GB | aliased GB | temp GB | peak estimate GB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['loop']} | {r['argument_size_in_bytes']} | {r['output_size_in_bytes']} | "
              f"{r['alias_size_in_bytes']} | {r['temp_size_in_bytes']} | {r['peak_estimate_bytes']} |")


if __name__ == "__main__":
    main()
