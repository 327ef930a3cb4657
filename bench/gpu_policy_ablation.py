"""Ablation of the GPT mixed-precision policy and XLA options on one GPU, against the competent peer.

Each variant is the kit's JaxEngine (AOT compile, donated state) over a GPT whose numerics are
chosen here; the peer is bench/gpu_peer.py. For every variant the peer and the variant run
alternately in one process (same batch, same clocks), `--repeats` times `--steps` steps each;
the row reports both medians, so the peer's own spread across rows shows the noise. XLA's memory
analysis (temp = scratch) is reported beside each.

    python3 bench/gpu_policy_ablation.py --model gpt12 --out $OUT      # on the GPU machine

Variants (cumulative unless said):
  legacy      the GPT before issue 16: fp32 tied logits, one qkv matmul sliced, log_softmax loss
  bf16logits  tied logits in bf16 (logits upcast inside the loss)
  fusedce     + alpa_job.losses.cross_entropy (custom VJP, no fp32 vocab-size residual)
  splitqkv    + q, k, v from three matmuls (no strided slices of one qkv output)
  opt:NAME    fusedce + one XLA compiler option (see OPTIONS)
  product     the kit's GPT as it is
  mubf16      product with Adam's first moment in bf16 (a numerics change: an option, not a default)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time
from types import SimpleNamespace
from typing import Any

import lib.checkout  # noqa: F401 - first: alpa_job from this checkout

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import gpu_peer
from gpu_common import GPT_CASES, PEAK_TFLOPS_H100, Loop, gpt_case, gpt_flops, park
from lib import results
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.models import ModelSpec
from alpa_job.models.axes import EMBED, HEADS, KV, MLP, SEQ, VOCAB, logical
from alpa_job.models.gpt import _layer_norm, _normal, causal_attention
from alpa_job.losses import cross_entropy

MODELS = GPT_CASES
OPTIONS = {
    "notriton": {"xla_gpu_enable_triton_gemm": False},
    "cublaslt": {"xla_gpu_enable_cublaslt": True},
    "cudnngemm": {"xla_gpu_cudnn_gemm_fusion_level": 2},
    "exhaustive": {"xla_gpu_exhaustive_tiling_search": True},
    "autotune5": {"xla_gpu_autotune_level": 5},
}


class _Attention(nn.Module):
    num_heads: int
    dtype: Any
    split_qkv: bool

    @nn.compact
    def __call__(self, x):
        d_model = x.shape[-1]
        head_dim = d_model // self.num_heads
        if self.split_qkv:
            kernel = self.param("qkv_kernel", logical(_normal, (EMBED, None, HEADS, KV)), (d_model, 3, self.num_heads, head_dim))
            bias = self.param("qkv_bias", logical(nn.initializers.zeros, (None, HEADS, KV)), (3, self.num_heads, head_dim))
            xc, kc, bc = x.astype(self.dtype), kernel.astype(self.dtype), bias.astype(self.dtype)
            q, k, v = (jnp.einsum("bse,ehd->bshd", xc, kc[:, i]) + bc[i] for i in range(3))
        else:
            qkv = nn.DenseGeneral(
                (3, self.num_heads, head_dim),
                dtype=self.dtype,
                name="qkv",
                kernel_init=logical(_normal, (EMBED, None, HEADS, KV)),
                bias_init=logical(nn.initializers.zeros, (None, HEADS, KV)),
            )(x)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = causal_attention(q, k, v, "auto")
        return nn.DenseGeneral(
            d_model,
            axis=(-2, -1),
            dtype=self.dtype,
            name="out",
            kernel_init=logical(_normal, (HEADS, KV, EMBED)),
            bias_init=logical(nn.initializers.zeros, (EMBED,)),
        )(out)


class _Block(nn.Module):
    num_heads: int
    dtype: Any
    split_qkv: bool

    @nn.compact
    def __call__(self, x):
        x = x + _Attention(self.num_heads, self.dtype, self.split_qkv)(_layer_norm(self.dtype)(x))
        d = x.shape[-1]
        y = nn.Dense(4 * d, dtype=self.dtype, kernel_init=logical(_normal, (EMBED, MLP)), bias_init=logical(nn.initializers.zeros, (MLP,)))(
            _layer_norm(self.dtype)(x)
        )
        y = nn.Dense(d, dtype=self.dtype, kernel_init=logical(_normal, (MLP, EMBED)), bias_init=logical(nn.initializers.zeros, (EMBED,)))(
            nn.gelu(y)
        )
        return x + y


class AblationGPT(nn.Module):
    """The kit's GPT (same parameters) with the policy choices as switches."""

    num_layers: int
    d_model: int
    num_heads: int
    seq_len: int
    vocab_size: int
    dtype: Any = jnp.bfloat16
    logits_fp32: bool = False
    split_qkv: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab_size, self.d_model, embedding_init=logical(_normal, (VOCAB, EMBED)), name="wte")
        pos = self.param("wpe", logical(_normal, (SEQ, EMBED)), (self.seq_len, self.d_model))
        x = (embed(tokens) + pos[: tokens.shape[1]]).astype(self.dtype)
        for _ in range(self.num_layers):
            x = _Block(self.num_heads, self.dtype, self.split_qkv)(x)
        x = _layer_norm(self.dtype)(x)
        if self.logits_fp32:
            return embed.attend(x.astype(jnp.float32))
        return jnp.einsum("bsd,vd->bsv", x, embed.embedding.astype(self.dtype))


def _fused_next_token_loss(logits, batch):
    return cross_entropy(logits, batch["tokens"][:, 1:]).mean(axis=-1)


class OptionsEngine(JaxEngine):
    """JaxEngine whose step is compiled with extra XLA compiler options."""

    compiler_options: dict = {}

    def compile(self):
        abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding) for k, v in self._example.items()}
        jitted = jax.jit(
            self._train_step,
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, NamedSharding(self.mesh, PartitionSpec())),
            donate_argnums=(0,),
            compiler_options=self.compiler_options or None,
        )
        start = time.perf_counter()
        self._compiled = jitted.lower(self.abstract_state, abstract_batch).compile()
        self._jitted = jitted
        self.stats.compile_seconds += time.perf_counter() - start
        self.stats.compiles += 1
        from alpa_job.record.jax_program import memory_analysis

        self.stats.memory = memory_analysis(self._compiled)
        return self.stats


class MuBf16Engine(OptionsEngine):
    """`mubf16`: the kit's Adam with its first moment kept in bf16 (optax's mu_dtype: half the bytes of
    one of Adam's three fp32 reads and writes per parameter)."""

    def make_optimizer(self, peak_learning_rate, horizon):
        import optax

        from alpa_job.engines.optimizer import learning_rate_schedule

        return optax.adam(learning_rate_schedule(peak_learning_rate, horizon), mu_dtype=jnp.bfloat16)


def build_engine(name: str, config, spec: ModelSpec, batch):
    """The variant's engine."""
    return (MuBf16Engine if name == "mubf16" else OptionsEngine)(config, spec, batch, "data", (1, 1))


def variant_spec(name: str, config, base: ModelSpec):
    """(ModelSpec, compiler options) for a variant name."""
    m = SimpleNamespace(**config.model_args)
    kw = dict(num_layers=m.num_layers, d_model=m.d_model, num_heads=m.num_heads, seq_len=m.seq_len, vocab_size=m.vocab_size)
    options = {}
    if name in ("product", "mubf16"):  # whatever alpa_job/models/gpt.py and the shared loss do now
        return base, options
    if name == "legacy":
        module, loss = AblationGPT(**kw, logits_fp32=True), base.loss
    elif name == "bf16logits":
        module, loss = AblationGPT(**kw), base.loss
    elif name == "fusedce":
        module, loss = AblationGPT(**kw), _fused_next_token_loss
    elif name == "splitqkv":
        module, loss = AblationGPT(**kw, split_qkv=True), _fused_next_token_loss
    elif name.startswith("opt:"):
        parts = name[4:].split("+")
        module, loss = AblationGPT(**kw, split_qkv="split" in parts), _fused_next_token_loss
        for p in parts:
            options.update(OPTIONS.get(p, {}))
    else:
        raise SystemExit(f"unknown variant {name}")
    # repeated_blocks=None: the ablation's blocks are not the kit's DecoderBlock; initialise whole.
    return dataclasses.replace(base, module=type(base.module)(module), loss=loss, repeated_blocks=None), options


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--variants", default="legacy,bf16logits,fusedce,splitqkv")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS_H100)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    config, base, batch = gpt_case(args.model)
    m = SimpleNamespace(**config.model_args)
    t0 = time.perf_counter()
    peer_run, peer_holder, n_params, peer_compiled = gpu_peer.make_loop(
        m.num_layers, m.d_model, m.num_heads, m.vocab_size, m.seq_len, 1e-4, batch["tokens"]
    )
    peer_mem = peer_compiled.memory_analysis()
    print(f"# peer compiled in {time.perf_counter() - t0:.1f}s, temp {peer_mem.temp_size_in_bytes / 1e9:.2f} GB", flush=True)
    flops = gpt_flops(n_params, config.batch_size, m.seq_len, m.num_layers, m.d_model)
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, f"gpu_ablation_{args.model}.jsonl")
    park(peer_holder)
    initial = {}  # host copy of the first variant's initial state, per parameter layout (init is slow)
    rows = []
    for name in args.variants.split(","):
        spec, options = variant_spec(name, config, base)
        row = {"model": args.model, "variant": name, "options": options}
        try:
            t0 = time.perf_counter()
            engine = build_engine(name, config, spec, batch)
            engine.compiler_options = options
            engine.compile()
            layout = str(jax.tree_util.tree_structure(engine.abstract_state))
            if layout not in initial:
                initial[layout] = [engine.init_state(0)]
                park(initial[layout])
            holder = [
                jax.tree_util.tree_map(  # a fresh copy, parked like the peer's state
                    lambda x: jax.device_put(x, x.sharding, may_alias=False) if isinstance(x, jax.Array) else x, initial[layout][0]
                )
            ]
            device_batch = engine.put_batch(batch)

            def kit_run(n, engine=engine, holder=holder, device_batch=device_batch):
                s = holder[0]
                loss = None
                for _ in range(n):
                    s, loss = engine.step(s, device_batch)
                jax.block_until_ready(loss)
                holder[0] = s
                return loss

            kit = Loop("kit", kit_run, holder, engine.state_sharding)
            peer = Loop("peer", peer_run, peer_holder)
            build_s = time.perf_counter() - t0
            for _ in range(args.repeats):
                peer.time(args.steps, parked=True)
                kit.time(args.steps, parked=True)
            p, k = peer.median_s, kit.median_s
            row.update(
                peer_ms=round(p * 1e3, 2),
                kit_ms=round(k * 1e3, 2),
                kit_vs_peer=round(p / k, 3),
                kit_mfu=round(flops / k / 1e12 / args.peak_tflops, 3),
                peer_mfu=round(flops / p / 1e12 / args.peak_tflops, 3),
                peer_samples_ms=[round(x * 1e3, 2) for x in peer.samples],
                kit_samples_ms=[round(x * 1e3, 2) for x in kit.samples],
                compile_s=round(engine.stats.compile_seconds, 1),
                build_s=round(build_s, 1),
                kit_temp_gb=round(engine.stats.memory["temp_size_in_bytes"] / 1e9, 2),
                peer_temp_gb=round(peer_mem.temp_size_in_bytes / 1e9, 2),
            )
            del engine, kit, kit_run, device_batch, holder
        except Exception as e:  # noqa: BLE001 - an unknown XLA option must not end the campaign
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        gc.collect()
        rows.append(row)
        print(json.dumps(row), flush=True)
        results.append_row(out_path, row)
    print(
        f"\n{args.model} ({jax.devices()[0].device_kind}, jax {jax.__version__}), params {n_params}, "
        f"{args.repeats}x{args.steps} steps alternating"
    )
    print(f"{'variant':28s} {'peer ms':>8s} {'kit ms':>8s} {'kit/peer':>8s} {'MFU':>6s} {'temp GB':>8s} {'peer tmp':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:28s} ERROR {r['error'][:80]}")
        else:
            print(
                f"{r['variant']:28s} {r['peer_ms']:8.2f} {r['kit_ms']:8.2f} {r['kit_vs_peer']:8.3f} "
                f"{r['kit_mfu']:6.3f} {r['kit_temp_gb']:8.2f} {r['peer_temp_gb']:8.2f}"
            )


if __name__ == "__main__":
    main()
