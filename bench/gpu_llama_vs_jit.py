"""The LLaMA example through the kit against a plain jax.jit loop over the same module, one GPU (issue 21).

The proof asks: "On one GPU, the LLaMA example at ~1B parameters runs at >= 0.95 of a plain jax.jit
loop over the same module (bench/, measured in one run)."

- kit: `--model llama_example.model:build` exactly as the CLI builds it in-process (`--address none`):
  JobConfig -> models.resolve (the builder imported, its LlamaArgs typed from --model-arg values) ->
  get_model -> prepare_data (the example's synthetic data) -> train.loop.build_jax_engine (strategy
  data, mesh from the visible devices, the learning-rate horizon the CLI computes), bf16.
- peer: what a competent user writes over the SAME flax module (the example's `build(...).module`):
  `module.init` for fp32 parameters, plain `jax.jit` (no donation: the default a user gets),
  optax Adam under the same warmup + cosine schedule as the kit's optimizer (written here in optax,
  checked equal to the kit's), optax's integer-label cross-entropy over the bf16 logits upcast to
  fp32, the same token batch.
- extras, labelled as diagnostics, not peers: `donate` (the peer with its state donated, as the kit
  does) and `kitloss` (the peer with the example's own loss, the kit's fused cross-entropy).

The loops run alternately, `--repeats` rounds of `--steps` steps each, each loop's state parked in
host memory while another runs (bench/gpu_common.py says why); medians are reported.

    PYTHONPATH=.:examples/llama python3 bench/gpu_llama_vs_jit.py --case 1b --out $OUT   # the GPU machine
    PYTHONPATH=.:examples/llama python3 bench/gpu_llama_vs_jit.py --case tiny --out /tmp/x # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lib.checkout import REPO  # first: alpa_job from this checkout

LLAMA = str(REPO / "examples" / "llama")  # the example's own package (llama_example), as a run gets it
if LLAMA not in sys.path:
    sys.path.insert(0, LLAMA)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from gpu_common import PEAK_TFLOPS_H100, Loop, alternate, engine_loop, gpt_flops  # noqa: E402
from gpu_peer import jit_run  # noqa: E402
from lib.results import save_result  # noqa: E402

CASES = {
    # ~1B: 18 layers, d 2048, 16 heads (8 kv heads), SwiGLU 5632, vocab 32000; 8 x 1024 tokens a step.
    "1b": dict(
        model=dict(num_layers=18, d_model=2048, num_heads=16, num_kv_heads=8, mlp_dim=5632, vocab_size=32000, seq_len=1024), batch=8
    ),
    "tiny": dict(
        model=dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=176, vocab_size=256, seq_len=64), batch=2
    ),  # CPU smoke
}
MODEL = "llama_example.model:build"


# ----------------------------------------------------------------------------- the kit, as the CLI builds it
def kit_loop(sizes: dict, batch: int, lr: float, steps: int):
    """(Loop, engine, config, example batch): JaxEngine over the example, built as `alpa_job train
    --model llama_example.model:build --model-arg ... --address none --strategy data --dtype bfloat16`."""
    from alpa_job.models import get_model, resolve
    from alpa_job.settings.config import JobConfig
    from alpa_job.train.loop import build_jax_engine, prepare_data

    config = JobConfig(
        model=MODEL,
        model_args={k: str(v) for k, v in sizes.items()},
        dtype="bfloat16",
        address="none",
        strategy="data",
        batch_size=batch,
        num_samples=batch,
        steps=steps,
        learning_rate=lr,
    ).validated()
    config = resolve(config)  # runner._resolve_model: import the builder, type its settings, call it once
    model = get_model(config)
    data = prepare_data(config, model)
    engine = build_jax_engine(config, model, data)
    return engine_loop(engine, config.seed, data.example), engine, config, data.example


# ----------------------------------------------------------------------------- the peer (no kit code)
def peer_schedule(peak: float, total_steps: int):
    """Linear warmup over min(1000, total/5) steps from peak/(warmup+1), cosine decay to peak/10 by
    the last step: what the kit's optimizer does, written out with optax."""
    warmup = max(1, min(1000, total_steps // 5))
    return optax.warmup_cosine_decay_schedule(
        init_value=peak / (warmup + 1), peak_value=peak, warmup_steps=warmup, decay_steps=total_steps, end_value=peak * 0.1
    )


def optax_loss(module, params, tokens):
    logits = module.apply({"params": params}, tokens)  # bf16 logits [B, S, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()


def example_loss(model, params, tokens):
    """The example's own loss (api.cross_entropy: the kit's fused log-sum-exp)."""
    logits = model.module.apply({"params": params}, tokens)
    return model.loss(logits, {"tokens": tokens}).mean()


def peer_loop(name: str, model, tokens: np.ndarray, lr: float, horizon: int, donate: bool = False, kit_loss: bool = False):
    """(Loop, n_params, compiled step): plain jax.jit + optax Adam over `model.module`."""
    from flax.core import meta

    module = model.module
    tokens = jax.device_put(jnp.asarray(tokens))
    params = meta.unbox(jax.jit(module.init)(jax.random.PRNGKey(0), tokens)["params"])
    tx = optax.adam(peer_schedule(lr, horizon))
    opt_state = tx.init(params)

    def loss_fn(p, t):
        return example_loss(model, p, t) if kit_loss else optax_loss(module, p, t)

    def train_step(p, o, t):
        loss, grads = jax.value_and_grad(loss_fn)(p, t)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    step = jax.jit(train_step, donate_argnums=(0, 1) if donate else ())
    compiled = step.lower(params, opt_state, tokens).compile()
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    return Loop(name, *jit_run(step, params, opt_state, tokens)), n_params, compiled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="1b", choices=sorted(CASES))
    parser.add_argument("--extras", default="donate,kitloss", help="diagnostic peers: donate,kitloss ('' for none)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--run-steps", type=int, default=1000, help="the run length the schedule is built for")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS_H100)
    parser.add_argument("--no-park", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    case = CASES[args.case]
    sizes, batch = case["model"], case["batch"]
    extras = [e for e in args.extras.split(",") if e]

    t0 = time.perf_counter()
    kit, engine, config, example = kit_loop(sizes, batch, args.lr, args.run_steps)
    t1 = time.perf_counter()
    horizon = engine._horizon
    from alpa_job.engines.optimizer import learning_rate_schedule

    kit_sched = learning_rate_schedule(config.learning_rate, horizon)
    ours = peer_schedule(config.learning_rate, horizon)
    for s in (0, 1, horizon // 5, horizon // 2, horizon):
        assert abs(float(kit_sched(s)) - float(ours(s))) <= 1e-9 * config.learning_rate + 1e-12, s

    # The peer's module: the example's builder, called directly (no kit code between).
    from llama_example.model import LlamaArgs, build

    model = build(LlamaArgs(**sizes), jnp.bfloat16)
    tokens = np.asarray(example["tokens"])
    peer, n_params, peer_compiled = peer_loop("peer", model, tokens, config.learning_rate, horizon)
    t2 = time.perf_counter()
    n_kit = sum(x.size for x in jax.tree_util.tree_leaves(engine.abstract_state.params))
    assert n_kit == n_params, f"kit has {n_kit} parameters, the peer {n_params}"
    assert float(np.asarray(example["mask"]).min()) == 1.0, "every row of the kit's batch is real"
    loops = [peer, kit]
    for extra in extras:
        loops.append(
            peer_loop(f"peer_{extra}", model, tokens, config.learning_rate, horizon, donate=extra == "donate", kit_loss=extra == "kitloss")[
                0
            ]
        )
    t3 = time.perf_counter()
    device = jax.devices()[0].device_kind
    print(
        f"# {args.case}: {n_params:,} parameters ({n_params / 1e9:.3f} B); schedule horizon {horizon}; "
        f"kit build+compile+init {t1 - t0:.1f}s, peer {t2 - t1:.1f}s, extras {t3 - t2:.1f}s",
        flush=True,
    )

    medians = alternate(loops, args.steps, args.repeats, parked=not args.no_park)
    tokens_per_step = batch * sizes["seq_len"]
    flops = gpt_flops(n_params, batch, sizes["seq_len"], sizes["num_layers"], sizes["d_model"])
    ms = {k: v * 1e3 for k, v in medians.items()}
    peer_mem = peer_compiled.memory_analysis()
    row = {
        "case": args.case,
        "sizes": sizes,
        "batch": batch,
        "params": n_params,
        "flops_per_step": flops,
        "schedule_horizon": horizon,
        "peer_donates": False,
        "kit_ms": round(ms["kit"], 2),
        "peer_ms": round(ms["peer"], 2),
        "kit_tokens_per_s": round(tokens_per_step / medians["kit"]),
        "peer_tokens_per_s": round(tokens_per_step / medians["peer"]),
        "kit_speed_vs_peer": round(medians["peer"] / medians["kit"], 3),  # >= 0.95 is the proof
        "kit_ms_over_peer_ms": round(medians["kit"] / medians["peer"], 3),
        "kit_mfu": round(flops / medians["kit"] / 1e12 / args.peak_tflops, 3),
        "peer_mfu": round(flops / medians["peer"] / 1e12 / args.peak_tflops, 3),
        "kit_temp_gb": round(engine.stats.memory["temp_size_in_bytes"] / 1e9, 2) if engine.stats.memory else None,
        "peer_temp_gb": round(peer_mem.temp_size_in_bytes / 1e9, 2) if peer_mem else None,
        "kit_compile_s": round(engine.stats.compile_seconds, 1),
        "extras_ms": {k: round(v, 2) for k, v in ms.items() if k.startswith("peer_")},
        "samples_ms": {loop.name: [round(s * 1e3, 2) for s in loop.samples] for loop in loops},
    }
    print(json.dumps(row), flush=True)
    path = save_result(
        f"gpu_llama_vs_jit-{args.case}",
        args.out,
        {"steps": args.steps, "repeats": args.repeats, "parked": not args.no_park, "peak_tflops": args.peak_tflops, "rows": [row]},
    )
    print(
        f"\n{device}, jax {jax.__version__}; {n_params:,} parameters; median of {args.repeats} alternating "
        f"rounds x {args.steps} steps; saved {path}"
    )
    print("| loop | step ms | tokens/s | MFU |")
    print("|---|---|---|---|")
    print(f"| plain jax.jit (peer, no donation) | {row['peer_ms']} | {row['peer_tokens_per_s']:,} | {row['peer_mfu']} |")
    print(f"| kit (JaxEngine, data, bf16) | {row['kit_ms']} | {row['kit_tokens_per_s']:,} | {row['kit_mfu']} |")
    for name, value in row["extras_ms"].items():
        print(
            f"| extra (diagnostic): {name} | {value} | {round(tokens_per_step / value * 1e3):,} | "
            f"{round(flops / value / 1e9 / args.peak_tflops, 3)} |"
        )
    print(f"kit speed / peer speed = {row['kit_speed_vs_peer']} (peer ms / kit ms); kit ms / peer ms = {row['kit_ms_over_peer_ms']}")


if __name__ == "__main__":
    main()
