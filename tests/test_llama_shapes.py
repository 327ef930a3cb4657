"""The LLaMA example at Llama 2 and Llama 3 shapes: each shipped llama preset, built through the kit's
own path, has the published parameter count; Llama 3.1's rotary frequency scaling matches the formula;
a tied head is x @ embedding.T; bad rope settings are one line naming the fix. Shapes only
(jax.eval_shape): nothing here allocates a multi-billion-parameter model."""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_DIR = os.path.join(REPO, "examples", "llama")
if LLAMA_DIR not in sys.path:  # what `pip install -e examples/llama` or Ray's --working-dir gives a run
    sys.path.insert(0, LLAMA_DIR)

from alpa_job.models import build_model  # noqa: E402
from alpa_job.settings.config import build_config, load_preset, load_settings  # noqa: E402
from llama_example.layers import Llama, RopeScaling, rope_inverse_frequencies, rotary  # noqa: E402
from llama_example.model import LlamaArgs, build  # noqa: E402

# The sizes Meta and Hugging Face publish for these checkpoints (safetensors' parameter totals).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama3-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
}


def shapes_of(model):
    """The model's parameter shapes, traced and never allocated."""
    tokens = jnp.zeros((1, 8), jnp.int32)  # parameter shapes do not depend on the sequence length
    return jax.eval_shape(model.module.init, jax.random.PRNGKey(0), tokens)["params"]


def count(params) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_llama_preset_has_the_published_parameter_count(name):
    config = build_config(load_settings(name, None), {})
    model, args = build_model(config)  # the kit's path: the preset's model_args typed by LlamaArgs's hints
    assert isinstance(args, LlamaArgs) and config.dtype == "bfloat16"
    params = shapes_of(model)
    assert count(params) == PUBLISHED[name]
    assert ("lm_head" in params) == (not args.tie_embeddings)


def test_repeated_blocks_carry_the_models_settings():
    """The shell and the block the fast initialiser and the pipeline build outside the model are the
    model's: same eps, rope scaling and tying, and together they hold every parameter."""
    config = build_config(load_settings("llama3.2-1b", None), {})
    model, args = build_model(config)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    repeated = model.repeated_blocks(tokens)
    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192)
    shell_module = repeated.shell.module  # the decoder behind the kit's token convention (NextTokenInputs)
    for part in (shell_module, repeated.block):
        assert (part.rms_norm_eps, part.rope_scaling, part.rope_theta) == (1e-5, scaling, 500000.0)
    assert shell_module.tie_embeddings and shell_module.num_layers == 0
    key = jax.random.PRNGKey(0)
    shell = jax.eval_shape(repeated.shell.init, key, jnp.zeros(tokens.shape, tokens.dtype))["params"]
    block = jax.eval_shape(repeated.block.init, key, repeated.block_input)["params"]
    assert "lm_head" not in shell
    assert count(shell) + args.num_layers * count(block) == PUBLISHED["llama3.2-1b"]


# ----------------------------------------------------------------------------- rotary frequencies
def llama3_frequencies_by_hand(head_dim, theta, factor, low, high, original_max_len):
    """Llama 3.1's published scaling, one frequency at a time, as its model card's code words it."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original_max_len / high:
            out.append(freq)
        elif wavelength > original_max_len / low:
            out.append(freq / factor)
        else:
            smooth = (original_max_len / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def test_llama3_rope_frequencies_follow_the_published_formula():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192)
    got = rope_inverse_frequencies(128, 500000.0, scaling)
    want = llama3_frequencies_by_hand(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # All three bands occur at this size, so each branch of the formula was compared.
    plain = rope_inverse_frequencies(128, 500000.0)
    kept, divided = np.isclose(got, plain, rtol=1e-12), np.isclose(got, plain / 8, rtol=1e-12)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_unscaled_rope_frequencies_are_theta_to_the_minus_2i_over_d():
    i = np.arange(64)
    np.testing.assert_allclose(rope_inverse_frequencies(128, 10000.0), 10000.0 ** (-2 * i / 128), rtol=1e-6)
    np.testing.assert_allclose(rope_inverse_frequencies(128, 500000.0, None), 500000.0 ** (-2 * i / 128), rtol=1e-6)


def test_rotary_turns_each_pair_by_the_scaled_frequencies():
    """A unit vector on coordinate j at position p lands on (cos, sin) of p x frequency j in the pair
    (j, j + head_dim/2): rotary reads its angles from rope_inverse_frequencies."""
    head_dim, seq = 16, 5
    scaling = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=64)
    freqs = rope_inverse_frequencies(head_dim, 10000.0, scaling)
    x = jnp.tile(jnp.eye(head_dim)[None, None, :, :], (1, seq, 1, 1))  # head j holds unit vector e_j
    out = np.asarray(rotary(x, 10000.0, scaling))
    angles = np.arange(seq)[:, None] * freqs[None, :]
    j = np.arange(head_dim // 2)
    np.testing.assert_allclose(out[0][:, j, j], np.cos(angles), atol=1e-5)
    np.testing.assert_allclose(out[0][:, j, j + head_dim // 2], np.sin(angles), atol=1e-5)


# ----------------------------------------------------------------------------- tied embeddings
TINY = dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=48, vocab_size=64)


def test_tied_model_has_no_head_and_its_logits_are_x_times_the_embedding_transposed():
    tied = Llama(**TINY, tie_embeddings=True)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 12)), jnp.int32)
    variables = tied.init(jax.random.PRNGKey(0), tokens)
    params = variables["params"]
    assert "lm_head" not in params
    logits, state = tied.apply(variables, tokens, capture_intermediates=True, mutable=["intermediates"])
    x_final = state["intermediates"]["final_norm"]["__call__"][0]
    embedding = jax.tree_util.tree_leaves(params["embed"])[0]
    np.testing.assert_allclose(logits, x_final @ embedding.T, rtol=1e-5, atol=1e-5)
    # The same as an untied model whose head is the embedding's transpose: tying changes nothing else.
    untied = Llama(**TINY)
    head = {"kernel": jax.tree_util.tree_map(lambda e: e.T, params["embed"]["embedding"])}
    untied_logits = untied.apply({"params": {**params, "lm_head": head}}, tokens)
    np.testing.assert_allclose(logits, untied_logits, rtol=1e-5, atol=1e-5)


def test_tied_head_computes_in_the_compute_dtype():
    model = build(LlamaArgs(**{k: v for k, v in TINY.items() if k != "mlp_dim"}, tie_embeddings=True), jnp.bfloat16)
    tokens = jnp.zeros((1, 5), jnp.int32)  # seq_len + 1: the decoder reads the first 4 and predicts the last 4
    logits = jax.eval_shape(lambda: model.module.apply(model.module.init(jax.random.PRNGKey(0), tokens), tokens))
    assert logits.dtype == jnp.bfloat16 and logits.shape == (1, 4, 64)


# ----------------------------------------------------------------------------- bad settings
@pytest.mark.parametrize(
    "change, fix",
    [
        (dict(rope_scaling="yarn"), "rope_scaling='yarn' is not known; use none or llama3"),
        (
            dict(rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=4.0),
            "rope_low_freq_factor=4.0 must be below rope_high_freq_factor=4.0; e.g. rope_low_freq_factor=1 rope_high_freq_factor=4",
        ),
        (dict(rope_low_freq_factor=8.0), "must be below rope_high_freq_factor=4.0"),
        (dict(rope_factor=0.0), "must be > 0; e.g. rope_factor=8"),
    ],
)
def test_bad_rope_settings_are_one_line_naming_the_fix(change, fix):
    with pytest.raises(ValueError) as err:
        build(LlamaArgs(**change), None)
    assert fix in str(err.value) and "\n" not in str(err.value)


def test_a_files_model_args_change_its_bases_one_by_one(tmp_path):
    """llama2-13b names only the sizes that differ from llama2-7b: a base_config chain merges model_args
    key by key, as --config and --model-arg do on top of a preset."""
    (tmp_path / "base.yaml").write_text("model: llama_example.model:build\nmodel_args: {vocab_size: 32000, num_layers: 32}\n")
    (tmp_path / "child.yaml").write_text("base_config: base\nmodel_args: {num_layers: 40}\n")
    assert load_preset("child", presets_dir=str(tmp_path))["model_args"] == {"vocab_size": 32000, "num_layers": 40}


# ----------------------------------------------------------------------------- remat
def test_remat_keeps_the_parameters_and_numbers_and_fewer_residuals():
    """remat=dots / full: the same parameters, loss and gradients as none (what a checkpoint or an import
    holds does not change), and the backward keeps fewer of the forward's values."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    def kept(f, *args) -> int:  # the values the backward keeps (jax's public listing prints one a line)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(f, *args)
        return len(out.getvalue().splitlines())

    base = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, vocab_size=64, seq_len=16, attention="einsum")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)
    batch = {"tokens": tokens}
    reference = build(LlamaArgs(**base), jnp.float32)
    params = reference.module.init(jax.random.PRNGKey(0), tokens)["params"]
    results = {}
    for remat in ("none", "dots", "full"):
        model = build(LlamaArgs(**base, remat=remat), jnp.float32)
        assert jax.tree_util.tree_structure(model.module.init(jax.random.PRNGKey(0), tokens)["params"]) == jax.tree_util.tree_structure(
            params
        )

        def loss(p, model=model):
            return model.loss(model.module.apply({"params": p}, tokens), batch).mean()

        results[remat] = (jax.value_and_grad(loss)(params), kept(loss, params))
    (loss_none, grads_none), kept_none = results["none"]
    for remat in ("dots", "full"):
        (value, grads), kept = results[remat]
        np.testing.assert_allclose(value, loss_none, rtol=1e-6)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, grads_none)
        assert kept < kept_none, (remat, kept, kept_none)
    assert results["full"][1] < results["dots"][1]
    with pytest.raises(ValueError, match="remat='some' is not known; use one of: none, dots, full"):
        build(LlamaArgs(**base, remat="some"), jnp.float32)
