"""The kit's JAX engine against a plain hand-written jax.jit loop, same model, same run, one GPU.

Both loops train the same flax module with Adam on the same batch. The plain loop is what a user
writes first (jit, no donation); the kit's is JaxEngine (AOT compile, donated state, sharding from
rules). Median per-step time over repeats, after warm-up; FLOPs as in ../shared/notes/gpu.md.

    python bench/gpu_engine_vs_jit.py --out bench/results   # on a GPU machine (no Ray needed)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from alpa_job.config import JobConfig  # noqa: E402
from alpa_job.data import epoch_batches, synthetic  # noqa: E402
from alpa_job.engines.jax_engine import JaxEngine  # noqa: E402
from alpa_job.models import get_model  # noqa: E402

CASES = {
    "mlp-fp32": dict(model="mlp", hidden_dim=2048, batch_size=2048, num_samples=2048, dtype="float32"),
    "mlp-bf16": dict(model="mlp", hidden_dim=2048, batch_size=2048, num_samples=2048, dtype="bfloat16"),
    "gpt12-d1024-bf16": dict(model="gpt", num_layers=12, d_model=1024, num_heads=16, seq_len=1024,
                             vocab_size=32768, batch_size=16, num_samples=16, dtype="bfloat16"),
}


def flops_per_step(config, n_params: int) -> float:
    if config.model == "mlp":
        return 6.0 * n_params * config.batch_size
    tokens = config.batch_size * config.seq_len
    return 6.0 * n_params * tokens + 12.0 * config.num_layers * config.batch_size * config.seq_len ** 2 * config.d_model


def plain_loop(config, model, batch):
    """What a user writes by hand: jit the step, no donation, no sharding, textbook attention."""
    if config.model == "gpt":
        import dataclasses

        from alpa_job.models.gpt import GPT

        inner = model.module.module  # the GPT inside the tokens wrapper
        model = dataclasses.replace(model, module=type(model.module)(inner.clone(attention="einsum")))
        assert isinstance(inner, GPT)
    variables = model.module.init(jax.random.PRNGKey(0), jnp.asarray(batch[model.input_key]))
    variables = jax.tree_util.tree_map(lambda x: getattr(x, "value", x), variables,
                                       is_leaf=lambda x: hasattr(x, "value"))
    params = variables["params"]
    tx = optax.adam(config.learning_rate)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            out = model.module.apply({"params": p}, batch[model.input_key])
            per = model.loss(out, batch).astype(jnp.float32)
            return (per * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    device_batch = jax.device_put(batch)
    state = [params, opt_state]

    def run(n):
        p, o = state
        for _ in range(n):
            p, o, loss = step(p, o, device_batch)
        jax.block_until_ready(loss)
        state[0], state[1] = p, o

    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    return run, n_params


def kit_loop(config, model, batch):
    engine = JaxEngine(config, model, batch, "data", (len(jax.devices()), 1))
    engine.compile()
    device_batch = engine.put_batch(batch)
    state = [engine.init_state(0)]

    def run(n):
        s = state[0]
        for _ in range(n):
            s, loss = engine.step(s, device_batch)
        jax.block_until_ready(loss)
        state[0] = s

    return run


def time_loop(run, steps: int, repeats: int) -> float:
    run(3)  # warm-up (and compile for the plain loop)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(steps)
        samples.append((time.perf_counter() - start) / steps)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=798.0, help="bf16 dense peak for MFU (H100 SXM)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    rows = []
    for name in args.cases.split(","):
        config = JobConfig(**CASES[name], address="none", learning_rate=1e-4).validated()
        model = get_model(config)
        batch, _ = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))
        plain_run, n_params = plain_loop(config, model, batch)
        kit_run = kit_loop(config, model, batch)
        # Alternate the two loops so drift (clocks, thermals, order) hits both equally.
        plain_s = kit_s = None
        plain_samples, kit_samples = [], []
        for _ in range(args.repeats):
            plain_samples.append(time_loop(plain_run, args.steps, 1))
            kit_samples.append(time_loop(kit_run, args.steps, 1))
        plain_s, kit_s = statistics.median(plain_samples), statistics.median(kit_samples)
        flops = flops_per_step(config, n_params)
        row = {"case": name, "params": n_params, "plain_ms": round(plain_s * 1e3, 3), "kit_ms": round(kit_s * 1e3, 3),
               "kit_vs_plain": round(plain_s / kit_s, 3), "kit_tflops": round(flops / kit_s / 1e12, 1),
               "kit_mfu": round(flops / kit_s / 1e12 / args.peak_tflops, 3),
               "plain_tflops": round(flops / plain_s / 1e12, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "steps": args.steps,
              "repeats": args.repeats, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_engine_vs_jit.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
