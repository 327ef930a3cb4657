"""The state initialiser by parts (engines/state_init.py): the whole model's tree, names, shapes,
logical axes and shardings, a fresh random draw per block, and a compile that does not grow with
the layer count (issue 16, item 2)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from alpa_job.settings.config import JobConfig
from alpa_job.data import epoch_batches, synthetic
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.engines.state_init import StateInitializer
from alpa_job.models import get_model
from helpers_train import job_config


def _gpt(num_layers: int = 3):
    config = job_config(
        model="gpt",
        num_layers=num_layers,
        d_model=64,
        num_heads=4,
        seq_len=32,
        vocab_size=128,
        num_samples=8,
        batch_size=8,
        steps=1,
        address="none",
        compile_cache="none",
    ).validated()
    batch, _ = next(epoch_batches(synthetic(config), 8, "drop", 0, 0))
    return config, get_model(config), batch


def _engine(num_layers: int = 3, whole: bool = False, mesh=(8, 1), strategy="data"):
    config, model, batch = _gpt(num_layers)
    if whole:
        model = dataclasses.replace(model, repeated_blocks=None)
    return JaxEngine(config, model, batch, strategy, mesh)


def _described(tree):
    """path -> (shape, dtype, logical axes or sharding spec) of every leaf."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    out = {}
    for path, leaf in leaves:
        names = getattr(leaf, "names", None)
        value = leaf.value if isinstance(leaf, nn.Partitioned) else leaf
        out[jax.tree_util.keystr(path)] = (tuple(value.shape), str(value.dtype), names)
    return out


def test_gpt_initialises_by_parts():
    assert _engine()._initializer.parts is not None
    assert _engine(whole=True)._initializer.parts is None


def test_parts_give_the_whole_models_tree_shapes_and_logical_axes():
    parts, whole = _engine(), _engine(whole=True)
    # Each engine has its own optimizer object (a static field of the state): compare without it.
    by_parts = parts._initializer.abstract_boxed().replace(tx=None)
    by_whole = whole._initializer.abstract_boxed().replace(tx=None)
    assert jax.tree_util.tree_structure(by_parts) == jax.tree_util.tree_structure(by_whole)
    assert _described(by_parts) == _described(by_whole)
    assert parts.abstract_state.replace(tx=None) == whole.abstract_state.replace(tx=None)  # with shardings
    assert len(parts.abstract_state.params) == 3 + 3  # wte, wpe, final LayerNorm + 3 blocks


def test_state_by_parts_is_a_fresh_well_scaled_draw_per_block():
    engine = _engine(num_layers=3)
    engine.compile()
    state = engine.init_state(0)
    again = engine._initializer(0)
    other = engine._initializer(1)
    params = jax.device_get(state.params)
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])  # noqa: E731
    np.testing.assert_array_equal(flat(params), flat(jax.device_get(again.params)))  # a seed is a seed
    assert not np.array_equal(flat(params), flat(jax.device_get(other.params)))
    blocks = [params[f"DecoderBlock_{i}"] for i in range(3)]
    kernels = [b["Dense_0"]["kernel"] for b in blocks]
    assert not np.array_equal(kernels[0], kernels[1]) and not np.array_equal(kernels[1], kernels[2])
    for kernel in kernels + [params["wte"]["embedding"]]:
        assert abs(float(np.std(kernel)) - 0.02) < 0.002 and abs(float(np.mean(kernel))) < 0.002
    assert np.all(blocks[0]["LayerNorm_0"]["scale"] == 1.0) and np.all(blocks[2]["Dense_1"]["bias"] == 0.0)
    assert np.all(flat(jax.device_get(state.opt_state)) == 0.0)
    assert int(state.step) == 0 and state.step.dtype == np.int32


def test_initialiser_compiles_the_same_three_executables_for_any_layer_count():
    def compiles(num_layers: int) -> int:
        engine = _engine(num_layers)
        count = engine.watch_compiles()
        before = count()
        engine._initializer.lower(engine.abstract_state)
        engine._initializer.compile()
        return count() - before

    assert compiles(2) == compiles(8) == 3  # shell, one block, optimizer state


def test_state_is_created_already_sharded_on_the_mesh():
    engine = _engine(num_layers=2, mesh=(2, 4), strategy="tensor")
    engine.compile()
    state = engine.init_state(0)
    leaves = jax.tree_util.tree_leaves(state)
    wanted = jax.tree_util.tree_leaves(engine.state_sharding)
    assert len(leaves) == len(wanted)
    for leaf, want in zip(leaves, wanted):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.shape, leaf.sharding, want)
    assert any(not leaf.sharding.is_fully_replicated for leaf in leaves), "tensor splits some parameter"
    state, loss = engine.step(state, engine.put_batch(_gpt(2)[2]))
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("name", ["mlp", "wide_resnet"])
def test_models_without_parts_initialise_whole(name):
    config = JobConfig(model=name, num_samples=8, batch_size=8, steps=1, address="none", compile_cache="none").validated()
    batch, _ = next(epoch_batches(synthetic(config), 8, "drop", 0, 0))
    engine = JaxEngine(config, get_model(config), batch, "data", (8, 1))
    assert engine._initializer.parts is None
    engine.compile()
    state, loss = engine.step(engine.init_state(0), engine.put_batch(batch))
    assert np.isfinite(float(loss))


def test_state_initializer_needs_no_engine():
    config, model, batch = _gpt(2)
    example = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    init = StateInitializer(model, example, lambda params, stats: {"params": params})
    assert set(init.abstract_boxed()["params"]) == {"wte", "wpe", "LayerNorm_0", "DecoderBlock_0", "DecoderBlock_1"}
