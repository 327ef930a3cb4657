"""The example packages' Flax modules on their own (examples/llama, examples/resnet): shapes, the
logical axes every parameter carries, and the numerics that make them what they claim to be
(causal, rotary, grouped-query attention, ResNet-50's size, BatchNorm's statistics). The modules
import only jax and flax; training them through the kit is test_examples_train.py."""

from __future__ import annotations

import os
import sys
import tomllib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
for _name in ("llama", "resnet"):
    if os.path.join(EXAMPLES, _name) not in sys.path:
        sys.path.insert(0, os.path.join(EXAMPLES, _name))

from llama_example.layers import Attention, Llama, RMSNorm, rotary  # noqa: E402
from resnet_example.layers import ResNet  # noqa: E402


def kit_axis_names():
    """The logical axis names the kit's sharding rules know (the public API's, once it exists)."""
    try:
        from alpa_job import api as names
    except ImportError:
        from alpa_job.models import axes as names
    return {names.BATCH, names.EMBED, names.MLP, names.HEADS, names.KV, names.VOCAB, names.CHANNELS, names.CONV_IN, names.SEQ}


def partitioned_leaves(variables):
    leaves = jax.tree_util.tree_leaves_with_path(variables, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


def assert_every_param_has_logical_axes(params):
    known = kit_axis_names()
    leaves = partitioned_leaves(params)
    assert leaves
    for path, leaf in leaves:
        assert isinstance(leaf, nn.Partitioned), f"{path} carries no logical axes"
        assert len(leaf.names) == leaf.value.ndim, path
        # All-None is a declared "never split" (a 10-class bias), still a logical annotation.
        assert {n for n in leaf.names if n is not None} <= known, (path, leaf.names)


TINY_LLAMA = dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=48, vocab_size=64)


@pytest.fixture(scope="module")
def llama():
    module = Llama(**TINY_LLAMA)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 12)), jnp.int32)
    return module, module.init(jax.random.PRNGKey(0), tokens), tokens


def test_llama_maps_tokens_to_logits_and_every_parameter_has_logical_axes(llama):
    module, variables, tokens = llama
    assert module.apply(variables, tokens).shape == (2, 12, 64)
    assert_every_param_has_logical_axes(variables["params"])
    # Every weight of the decoder has a dimension some strategy may split.
    assert all(any(leaf.names) for _, leaf in partitioned_leaves(variables["params"]))
    shapes = jax.tree_util.tree_map(lambda x: x.shape, nn.unbox(variables["params"]))
    attention = shapes["layer_0"]["attention"]
    assert attention["query"]["kernel"] == (32, 4, 8) and attention["key"]["kernel"] == (32, 2, 8)
    assert shapes["layer_0"]["mlp"]["gate"]["kernel"] == (32, 48)
    assert "lm_head" in shapes  # untied output projection


def test_llama_is_causal(llama):
    module, variables, tokens = llama
    t = 5
    changed = tokens.at[:, t + 1].set((tokens[:, t + 1] + 1) % 64)
    before, after = module.apply(variables, tokens), module.apply(variables, changed)
    np.testing.assert_allclose(before[:, : t + 1], after[:, : t + 1], rtol=1e-6, atol=1e-6)
    assert not np.allclose(before[:, t + 1], after[:, t + 1])


def test_rotary_keeps_norms_and_depends_only_on_relative_position():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(1, 16, 2, 8)), jnp.float32)
    np.testing.assert_allclose(jnp.linalg.norm(rotary(x), axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    # The same q and k vector at every position: q_i . k_j depends on i - j only.
    q = jnp.broadcast_to(jnp.asarray(rng.normal(size=8), jnp.float32), (1, 16, 1, 8))
    k = jnp.broadcast_to(jnp.asarray(rng.normal(size=8), jnp.float32), (1, 16, 1, 8))
    dots = jnp.einsum("qd,kd->qk", rotary(q)[0, :, 0], rotary(k)[0, :, 0])
    np.testing.assert_allclose(dots[3, 1], dots[10, 8], rtol=1e-4)
    np.testing.assert_allclose(dots[1, 3], dots[12, 14], rtol=1e-4)


def test_rms_norm_gives_unit_rms():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 16)) * 5, jnp.float32)
    norm = RMSNorm()
    y = norm.apply(norm.init(jax.random.PRNGKey(0), x), x)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(y * y, axis=-1)), 1.0, rtol=1e-4)


def test_grouped_query_attention_equals_multi_head_with_each_kv_head_shared_by_its_group():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 10, 32)), jnp.float32)
    gqa = Attention(num_heads=4, num_kv_heads=2, attention="einsum")
    params = nn.unbox(gqa.init(jax.random.PRNGKey(0), x))["params"]
    # Query head h reads kv head h // 2: multi-head attention whose key/value heads repeat each GQA head twice.
    mha_params = dict(params, **{name: {"kernel": jnp.repeat(params[name]["kernel"], 2, axis=1)} for name in ("key", "value")})
    mha = Attention(num_heads=4, num_kv_heads=4, attention="einsum")
    np.testing.assert_allclose(gqa.apply({"params": params}, x), mha.apply({"params": mha_params}, x), rtol=1e-5, atol=1e-6)


def test_resnet50_has_the_cifar_resnet50_parameter_count():
    variables = jax.eval_shape(lambda: ResNet().init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False))
    count = sum(int(np.prod(leaf.value.shape)) for _, leaf in partitioned_leaves(variables["params"]))
    # torchvision's ResNet-50 with a 3x3 stem and a 10-class head; BatchNorm's scale and bias included.
    assert count == 23_520_842
    assert sum(1 for path, _ in partitioned_leaves(variables["params"]) if "block" in path and "conv" in path) == 16 * 3


@pytest.fixture(scope="module")
def tiny_resnet():
    module = ResNet(stage_sizes=(1, 1), base_width=8)
    images = jnp.asarray(np.random.default_rng(4).normal(size=(4, 32, 32, 3)) + 3.0, jnp.float32)
    return module, module.init(jax.random.PRNGKey(0), images, train=False), images


def test_resnet_classifies_and_every_parameter_has_logical_axes(tiny_resnet):
    module, variables, images = tiny_resnet
    assert module.apply(variables, images, train=False).shape == (4, 10)
    assert_every_param_has_logical_axes(variables["params"])
    assert set(variables) == {"params", "batch_stats"}


def test_resnet_training_pass_updates_batch_norm_statistics(tiny_resnet):
    module, variables, images = tiny_resnet
    logits, updates = module.apply(variables, images, train=True, mutable=["batch_stats"])
    assert logits.shape == (4, 10)
    stem_mean = updates["batch_stats"]["stem_bn"]["mean"]
    assert not np.allclose(stem_mean, variables["batch_stats"]["stem_bn"]["mean"])
    # The inference pass reads the statistics and changes nothing.
    assert module.apply(variables, images, train=False).shape == (4, 10)


@pytest.mark.parametrize(
    "example, package, entry_point",
    [
        ("llama", "llama_example", 'llama = "llama_example.model:build"'),
        ("resnet", "resnet_example", 'resnet50 = "resnet_example.model:build"'),
    ],
)
def test_each_example_is_a_package_with_its_own_pyproject(example, package, entry_point):
    root = os.path.join(EXAMPLES, example)
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["name"] == f"{example}-example"
    assert "alpa-cluster-kit" in project["dependencies"] and {"jax", "flax"} <= set(project["dependencies"])
    name, target = (s.strip().strip('"') for s in entry_point.split("="))
    assert project["entry-points"]["alpa_job.models"] == {name: target}
    assert os.path.isfile(os.path.join(root, package, "__init__.py"))
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    assert f"pip install -e examples/{example}" in readme and f"--working-dir examples/{example}" in readme
