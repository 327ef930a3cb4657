"""The step's model FLOPs counted on its jaxpr (engines/flops.py) agree with the textbook GPT formula,
count convolutions, and follow loops (issue 16, item 4: MFU in the report)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from alpa_job.settings.config import JobConfig
from alpa_job.data import epoch_batches, synthetic
from alpa_job.engines.flops import step_flops
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.models import get_model


def _engine(model: str, **fields):
    config = JobConfig(model=model, steps=1, address="none", compile_cache="none", **fields).validated()
    batch, _ = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))
    engine = JaxEngine(config, get_model(config), batch, "data", (8, 1))
    engine.compile()
    return config, engine


def test_gpt_step_flops_match_6_params_tokens_plus_attention():
    config, engine = _engine("gpt", num_layers=3, d_model=128, num_heads=4, seq_len=64, vocab_size=512,
                             num_samples=16, batch_size=16)
    params = sum(x.size for x in jax.tree_util.tree_leaves(engine.abstract_state.params))
    tokens = config.batch_size * config.seq_len
    formula = 6 * params * tokens + 12 * config.num_layers * config.batch_size * config.seq_len ** 2 * config.d_model
    counted = engine.stats.flops_per_step
    # The formula also counts the parameters no matmul uses (positions, LayerNorms, biases): < 2% here.
    assert counted == pytest.approx(formula, rel=0.02), (counted, formula)
    assert counted < formula


def test_convolutions_are_counted_and_scale_with_the_batch():
    _, small = _engine("wide_resnet", num_samples=8, batch_size=8)
    _, large = _engine("wide_resnet", num_samples=16, batch_size=16)
    assert small.stats.flops_per_step > 1e9  # a WRN-10-2 step on 32x32 images: GFLOPs, not the dense head's
    assert large.stats.flops_per_step == pytest.approx(2 * small.stats.flops_per_step, rel=1e-6)


def test_a_scan_counts_its_body_per_iteration_and_a_cond_its_costliest_branch():
    w = jnp.ones((64, 64))

    def one(x):
        return x @ w

    def scanned(x):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]

    def branched(x, p):
        return jax.lax.cond(p, lambda v: (v @ w) @ w, lambda v: v, x)

    x = jnp.ones((8, 64))
    single = step_flops(jax.jit(one).trace(x))
    assert single == 2 * 8 * 64 * 64
    assert step_flops(jax.jit(scanned).trace(x)) == 5 * single
    assert step_flops(jax.jit(branched).trace(x, True)) == 2 * single


def test_a_shard_map_counts_its_body_once_per_device_of_its_manual_axes():
    """The pipeline's step is a shard_map: its body is one device's work, so the step's count (all devices
    together) multiplies it by the devices that run it; an axis left automatic does not multiply."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from alpa_job.jax_compat import shard_map

    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    w = jnp.ones((64, 64))
    x = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P(("stage", "data"))))
    whole = step_flops(jax.jit(lambda v: v @ w).trace(x))
    split = shard_map()(lambda v: v @ w, mesh=mesh, in_specs=P(("stage", "data")), out_specs=P(("stage", "data")))
    assert step_flops(jax.jit(split).trace(x)) == whole  # 8 devices, an eighth of the rows each
    assert whole == 2 * 32 * 64 * 64


def test_report_has_flops_and_tflops_on_cpu(tmp_path):
    from alpa_job.train.loop import train_process

    config = JobConfig(model="gpt", num_layers=2, d_model=64, num_heads=4, seq_len=32, vocab_size=128,
                       num_samples=32, batch_size=8, steps=4, address="none", compile_cache="none",
                       out=str(tmp_path)).validated()
    timing = train_process(config).timing
    assert timing["flops_per_step"] and timing["flops_per_step"] > 0
    assert timing["tflops_per_device"] is not None
    assert timing["mfu"] is None  # no known peak for a CPU
