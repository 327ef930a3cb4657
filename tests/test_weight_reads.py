"""weight_reads: the dtype data parallelism's sharded update gathers each parameter in is the one the model
reads it in, found in the loss's jaxpr; anything the reader does not follow keeps full precision."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from alpa_job.data import epoch_batches, synthetic
from alpa_job.engines import weight_reads
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.models import get_model
from helpers_train import job_config

BF16, F32 = np.dtype("bfloat16"), np.dtype("float32")


def _gpt(dtype):
    config = job_config(
        model="gpt",
        dtype=dtype,
        address="none",
        num_layers=2,
        d_model=64,
        num_heads=4,
        seq_len=32,
        vocab_size=128,
        batch_size=8,
        num_samples=8,
        steps=2,
        compile_cache="none",
    ).validated()
    batch, _ = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))
    return config, get_model(config), batch


def _by_path(tree):
    return {jax.tree_util.keystr(path): np.dtype(d) for path, d in jax.tree_util.tree_leaves_with_path(tree)}


def test_a_bf16_gpt_gathers_its_dense_weights_in_bf16_and_what_it_reads_in_fp32_as_it_is():
    config, model, batch = _gpt("bfloat16")
    engine = JaxEngine(config, model, batch, "data", (jax.device_count(), 1))
    params = engine.abstract_state.params
    dtypes = _by_path(weight_reads.gather_dtypes(model, params, None, engine._example, config.dtype))
    full = sorted(path for path, d in dtypes.items() if d == F32)
    # The embedding (a lookup, and the tied output's weight), the positions added to it and the layer norms.
    assert full and all(("wte" in p or "wpe" in p or "LayerNorm" in p) for p in full), full
    narrow = [path for path, d in dtypes.items() if d == BF16]
    assert any("qkv" in p and "kernel" in p for p in narrow) and any("Dense_1" in p for p in narrow)
    assert set(dtypes.values()) == {BF16, F32}

    # The step gathers exactly those: its barrier (the cast before the gather) carries them.
    with engine.activation_layout():
        jaxpr = jax.make_jaxpr(engine._train_step)(engine.abstract_state, engine._abstract_batch())
    barrier = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "optimization_barrier")
    leaves = jax.tree_util.tree_leaves(params)
    assert [v.aval.dtype for v in barrier.invars] == [dtypes[p] for p in _by_path(params)]
    assert [v.aval.shape for v in barrier.invars] == [leaf.shape for leaf in leaves]


def test_an_fp32_model_gathers_every_weight_in_fp32_without_tracing(monkeypatch):
    config, model, batch = _gpt("float32")
    engine = JaxEngine(config, model, batch, "data", (jax.device_count(), 1))
    traced = []
    original = jax.make_jaxpr
    monkeypatch.setattr(jax, "make_jaxpr", lambda *a, **k: traced.append(1) or original(*a, **k))
    dtypes = weight_reads.gather_dtypes(model, engine.abstract_state.params, None, engine._example, "float32")
    assert set(_by_path(dtypes).values()) == {F32} and not traced


class _Toy:
    """A model whose loss reads each parameter one way."""

    @staticmethod
    def masked_loss(params, batch_stats, batch):
        x = batch["x"]
        y = x @ params["cast"].astype(jnp.bfloat16)
        y = y + jnp.sin(params["sin"]).astype(jnp.bfloat16)  # an fp32 read before the cast
        y = y + jax.checkpoint(lambda w: x @ w.astype(jnp.bfloat16))(params["in_checkpoint"])
        y = y + jax.jit(lambda w: w.astype(jnp.bfloat16))(params["in_jit"])

        @jax.custom_jvp
        def opaque(w):
            return w.astype(jnp.bfloat16)

        opaque.defjvp(lambda primals, tangents: (opaque(*primals), tangents[0].astype(jnp.bfloat16)))
        y = y + opaque(params["custom_jvp"])

        def body(carry, w):
            return carry + x @ w.astype(jnp.bfloat16), None

        y, _ = jax.lax.scan(body, y, params["scanned"])
        y = y + params["cast_to_f16"].astype(jnp.float16).astype(jnp.bfloat16)  # another narrow dtype
        return jnp.mean(y.astype(jnp.float32)), params["returned"]  # a parameter handed out: read whole


def test_only_reads_that_are_all_casts_to_the_compute_dtype_narrow_the_gather():
    w = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    names = ("cast", "sin", "in_checkpoint", "in_jit", "custom_jvp", "cast_to_f16", "returned")
    params = {**{n: w for n in names}, "scanned": jax.ShapeDtypeStruct((3, 4, 4), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((4, 4), jnp.bfloat16)}
    dtypes = weight_reads.gather_dtypes(_Toy, params, None, batch, "bfloat16")
    assert {n: np.dtype(d).name for n, d in dtypes.items()} == {
        "cast": "bfloat16",
        "in_checkpoint": "bfloat16",
        "in_jit": "bfloat16",
        "scanned": "bfloat16",
        "sin": "float32",
        "custom_jvp": "float32",
        "cast_to_f16": "float32",
        "returned": "float32",
    }


def test_gathering_the_cast_gives_the_loss_and_gradients_of_the_full_precision_weights():
    """Why the narrow gather changes no number: the loss of the cast weights equals the loss of the fp32
    ones, and the fp32 gradient is the narrow one cast back."""
    rng = np.random.default_rng(0)
    params = {n: jnp.asarray(rng.normal(size=(4, 4)), jnp.float32) for n in ("cast", "in_checkpoint", "in_jit")}
    x = jnp.asarray(rng.normal(size=(4, 4)), jnp.bfloat16)

    def loss(p):
        y = (
            x @ p["cast"].astype(jnp.bfloat16)
            + jax.checkpoint(lambda w: x @ w.astype(jnp.bfloat16))(p["in_checkpoint"])
            + jax.jit(lambda w: w.astype(jnp.bfloat16))(p["in_jit"])
        )
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    dtypes = weight_reads.gather_dtypes(_LossOnly(loss), params, None, {}, "bfloat16")
    cast = jax.tree_util.tree_map(lambda p, d: p.astype(d), params, dtypes)
    full_loss, full_grads = jax.value_and_grad(loss)(params)
    cast_loss, cast_grads = jax.value_and_grad(loss)(cast)
    assert float(full_loss) == float(cast_loss)
    for name in params:
        assert cast_grads[name].dtype == BF16
        np.testing.assert_array_equal(np.asarray(full_grads[name]), np.asarray(cast_grads[name].astype(jnp.float32)))


class _LossOnly:
    def __init__(self, loss):
        self.masked_loss = functools.partial(lambda f, params, batch_stats, batch: f(params), loss)
