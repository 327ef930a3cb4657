"""The GPU mixed-precision policy, checked on CPU: fp32 parameters, bf16 compute through the tied
output projection, a stable fp32 cross-entropy whose gradient matches the textbook form, and
defaults (warmup + decay) under which a small GPT's loss falls."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_job.settings.config import JobConfig
from alpa_job.data import epoch_batches, synthetic
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.engines.optimizer import learning_rate_schedule, warmup_steps
from alpa_job.models import get_model
from alpa_job.models.gpt import GPT
from alpa_job.losses import cross_entropy


def _textbook(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_cross_entropy_matches_the_textbook_loss_and_gradient(dtype):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(7), 3)
    # Large logits: a naive exp would overflow in bf16/fp32; the log-sum-exp must not.
    logits = (40.0 * jax.random.normal(k1, (3, 5, 97))).astype(dtype)
    labels = jax.random.randint(k2, (3, 5), 0, 97)
    weights = jax.random.normal(k3, (3, 5))

    ours, ref = cross_entropy(logits, labels), _textbook(logits, labels)
    assert ours.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(ours)))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-4)

    g_ours = jax.grad(lambda z: (cross_entropy(z, labels) * weights).sum())(logits)
    g_ref = jax.grad(lambda z: (_textbook(z, labels) * weights).sum())(logits)
    assert g_ours.dtype == dtype  # the gradient is written in the logits' dtype, no fp32 copy
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(g_ours, np.float32), np.asarray(g_ref, np.float32), atol=tol)
    # The gradient of one position's loss is softmax - onehot: each row sums to zero.
    np.testing.assert_allclose(
        np.asarray(jax.grad(lambda z: cross_entropy(z, labels).sum())(logits.astype(jnp.float32))).sum(-1), 0.0, atol=1e-5
    )


def test_gpt_keeps_fp32_params_and_computes_the_tied_logits_in_bf16():
    model = GPT(num_layers=1, d_model=32, num_heads=4, seq_len=16, vocab_size=64, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 16), 0, 64)
    variables = model.init(jax.random.PRNGKey(1), tokens)
    leaves = jax.tree_util.tree_leaves(variables["params"])
    assert leaves and all(getattr(x, "value", x).dtype == jnp.float32 for x in leaves)
    logits = model.apply(variables, tokens)
    assert logits.dtype == jnp.bfloat16 and logits.shape == (2, 16, 64)
    # The vocab-sized matmul in the compiled forward takes bf16 operands (the fp32 form is gone).
    hlo = jax.jit(model.apply).lower(variables, tokens).as_text()
    vocab_dots = [line for line in hlo.splitlines() if "dot_general" in line and re.search(r"->\s*tensor<2x16x64x\w+>", line)]
    assert len(vocab_dots) == 1, vocab_dots
    operand_and_result_types = re.findall(r"tensor<[0-9x]+x(\w+)>", vocab_dots[0])
    assert operand_and_result_types == ["bf16", "bf16", "bf16"], vocab_dots[0]
    # Same parameters in fp32 compute give nearly the same logits: bf16 is rounding, not a new model.
    ref = GPT(num_layers=1, d_model=32, num_heads=4, seq_len=16, vocab_size=64).apply(variables, tokens)
    assert float(jnp.max(jnp.abs(logits.astype(jnp.float32) - ref))) < 0.05


def test_schedule_warms_up_then_decays():
    assert warmup_steps(50) == 10 and warmup_steps(10**6) == 1000 and warmup_steps(None) == 100
    lr = learning_rate_schedule(1e-3, 50)
    rates = [float(lr(i)) for i in range(50)]
    assert 0 < rates[0] < rates[5] < rates[10] and abs(rates[10] - 1e-3) < 1e-9
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))  # non-increasing after warmup
    assert abs(rates[-1] - 1e-4) < 2e-5  # ends near a tenth of the peak


def test_small_gpt_loss_falls_at_defaults():
    """The kit's defaults (learning rate, schedule, Adam) on the default small GPT: 30 steps on one
    repeated batch of the synthetic task must bring the loss well down."""
    config = JobConfig(model="gpt", steps=30, address="none", num_samples=32, batch_size=32).validated()
    model = get_model(config)
    batch, _ = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))
    engine = JaxEngine(config, model, batch, "data", (len(jax.devices()), 1))
    engine.compile()
    state = engine.init_state(config.seed)
    device_batch = engine.put_batch(batch)
    losses = []
    for _ in range(config.steps):
        state, loss = engine.step(state, device_batch)
        losses.append(loss)
    losses = [float(x) for x in jax.device_get(losses)]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


def test_report_times_phases_and_the_steady_state_apart():
    """The record's `timing`: phases (compile, init, first step, time to first step), the steady
    state as median/p10/p90 of windowed step times (the first step not among them), XLA's FLOPs."""
    from alpa_job.launch.runner import run_in_process
    from helpers_train import tiny_config

    # No compile cache: an earlier test's identical step, stored, would make this one's compile a load.
    result = run_in_process(tiny_config("gpt", steps=41, epochs=100, compile_cache="none"))
    t = result.timing
    phases = t["phases_s"]
    assert phases["compile"] > 0 and phases["init_compile"] > 0 and phases["first_step"] > 0
    assert phases["to_first_step"] >= phases["setup_and_compile"] + phases["first_step"]
    steady = t["steady_step"]
    assert steady["windows"] == 20  # 40 steps after the first, windows of 2
    assert 0 < steady["p10_s"] <= steady["median_s"] <= steady["p90_s"]
    assert t["flops_per_step"] > 0 and t["tflops_per_device"] is not None
    assert t["mfu"] is None and t["mfu_datasheet"] is None  # CPU: no known peak, no MFU
    assert t["peak"]["precision"] == "fp32" and t["tokens_per_s_per_device"] > 0  # GPT declares its seq_len
