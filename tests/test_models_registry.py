"""Models as a registry, presets as config files: lookup, errors with a did-you-mean, the override
order (defaults -> preset and its bases -> --config -> flags), and every shipped preset."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from types import SimpleNamespace

import pytest

from alpa_job.settings import config as config_lib
from alpa_job.settings.config import JobConfig, build_config, load_preset, load_settings, preset_names
from alpa_job.errors import KitError
from alpa_job.models import BUILT_IN, builder_of, get_model, model_names, model_settings, model_values, size_settings
from helpers_train import tiny_config

SIZES = {s.name for s in size_settings()}  # the built-ins' sizes, which a file may give at its top level

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- the built-ins
def test_each_built_in_is_a_builder_of_the_public_api():
    """Built-ins are examples of alpa_job.api: `build(args, dtype)` in the module named like the model
    returns an api.Model; its sizes are its own settings (model_args), never job settings."""
    import jax.numpy as jnp

    from alpa_job import api

    assert list(BUILT_IN) == list(model_names()) == ["mlp", "wide_resnet", "gpt"]
    for name in BUILT_IN:
        builder = builder_of(name)
        assert builder.function.__module__ == f"alpa_job.models.{name}" and builder.target.endswith(":build")
        assert not set(builder.declaration.names) & set(config_lib.FIELD_NAMES)
        args = SimpleNamespace(**tiny_config(name).model_args)
        assert isinstance(builder.function(args, jnp.float32), api.Model)


def test_default_sizes_are_the_configs_defaults():
    defaults = JobConfig()
    declared = {name: {s.name: s.default for s in model_settings(name)} for name in BUILT_IN}
    assert declared == {
        "mlp": {"hidden_dim": 256},
        "wide_resnet": {"depth": 10, "width": 2},
        "gpt": {"num_layers": 2, "d_model": 128, "num_heads": 4, "seq_len": 64, "vocab_size": 256, "remat": "none"},
    }
    for name, sizes in declared.items():
        assert dict(model_values(defaults.replace(model=name))) == sizes


@pytest.mark.parametrize(
    "model, out_shape, input_key, batch_stats",
    [
        ("mlp", (2, 32), "x", False),  # hidden_dim 32
        ("wide_resnet", (2, 10), "image", True),  # 10 classes
        ("gpt", (2, 16, 64), "tokens", False),  # seq_len 16 positions x vocab 64
    ],
)
def test_get_model_builds_the_spec(model, out_shape, input_key, batch_stats):
    import jax
    import jax.numpy as jnp

    config = tiny_config(model)
    spec = get_model(config)
    assert (spec.name, spec.input_key, spec.has_batch_stats) == (model, input_key, batch_stats)
    inputs = {"mlp": jnp.zeros((2, 32)), "wide_resnet": jnp.zeros((2, 32, 32, 3)), "gpt": jnp.zeros((2, 17), jnp.int32)}[
        model
    ]  # gpt's batch holds seq_len + 1 tokens
    kwargs = {"train": False} if spec.has_batch_stats else {}
    variables = spec.module.init(jax.random.PRNGKey(0), inputs, **kwargs)
    outputs = spec.module.apply(variables, inputs, **kwargs)
    assert outputs.shape == out_shape


@pytest.mark.parametrize("model", BUILT_IN)
def test_synthetic_data_comes_from_the_model_and_feeds_it(model):
    """data.synthetic asks the built model: rows = --num-samples, the model's input field present,
    the same arrays for the same seed, other arrays for another seed; the module runs on a slice."""
    import jax
    import numpy as np

    from alpa_job.data import synthetic

    config = tiny_config(model, num_samples=6)
    arrays = synthetic(config).arrays
    spec = get_model(config)
    assert spec.input_key in arrays and {len(a) for a in arrays.values()} == {6}
    again = synthetic(config).arrays
    assert all(np.array_equal(arrays[k], again[k]) for k in arrays)
    other = synthetic(tiny_config(model, num_samples=6, seed=1)).arrays
    assert not np.array_equal(arrays[spec.input_key], other[spec.input_key])
    kwargs = {"train": False} if spec.has_batch_stats else {}
    inputs = arrays[spec.input_key][:2]
    variables = spec.module.init(jax.random.PRNGKey(0), inputs, **kwargs)
    assert spec.loss(spec.module.apply(variables, inputs, **kwargs), {k: v[:2] for k, v in arrays.items()}).shape == (2,)


def test_layer_facts_for_the_alpa_engine():
    import flax.linen as nn

    from alpa_job.models.gpt import DecoderBlock
    from alpa_job.models.wide_resnet import WideBlock

    cases = [
        ("mlp", {}, 4, nn.Dense),
        ("gpt", {"num_layers": 3}, 3, DecoderBlock),
        ("wide_resnet", {"depth": 16}, 6, WideBlock),
    ]  # 3 stages x 2 blocks
    for model, sizes, layers, cls in cases:
        spec = get_model(tiny_config(model, **sizes))
        assert (spec.layer_count, spec.layer_class) == (layers, cls)


def test_the_alpa_engine_counts_pipeline_layers_from_the_model():
    from alpa_job.engines import alpa_engine

    gpt = tiny_config("gpt", num_layers=6, engine="alpa", strategy="pipeshard-manual", pipeline_stages=3)
    assert alpa_engine.method_settings(gpt, 3, 1)["boundaries"] == [1, 3]  # 6 DecoderBlocks in 3 stages
    wrn = tiny_config("wide_resnet", depth=22, engine="alpa", strategy="pipeshard-auto")
    assert alpa_engine.method_settings(wrn, 2, 1)["layer_num"] == get_model(wrn).layer_count == 9
    for model in BUILT_IN:
        config = tiny_config(model)
        assert alpa_engine._layer_class(config) is get_model(config).layer_class


def test_unknown_model_is_one_line_listing_the_names():
    with pytest.raises(KitError) as err:
        model_values(build_config({}, {"model": "resnet"}))
    assert str(err.value) == (
        "--model 'resnet' is not known; use one of: mlp, wide_resnet, gpt, or your own builder "
        "as PACKAGE.MODULE:FUNCTION (did you mean wide_resnet?)"
    )
    with pytest.raises(KitError) as err:
        builder_of("transformer")
    assert str(err.value) == (
        "--model 'transformer' is not known; use one of: mlp, wide_resnet, gpt, or your own builder as PACKAGE.MODULE:FUNCTION"
    )


def test_checking_a_model_name_does_not_import_jax():
    """The config validates --model before the runner decides whether to emulate CPU devices, which it
    does only while jax is not imported yet."""
    code = (
        "import sys; from alpa_job.settings.config import build_config; build_config({'model': 'gpt'}, {}); "
        "print('jax' in sys.modules, 'flax' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


# ----------------------------------------------------------------------------- presets
def test_the_shipped_presets():
    assert preset_names() == [
        "gpt-12l",
        "gpt-24l",
        "gpt-4b",
        "gpt-small",  # gpt-4b: added for fsdp
        "llama2-13b",
        "llama2-7b",
        "llama3-8b",
        "llama3.2-1b",  # test_llama_shapes.py
        "mlp-tutorial",
        "wide-resnet-16",
    ]


@pytest.mark.parametrize("name", preset_names())
def test_each_preset_loads_into_a_valid_config(name):
    values = load_preset(name)
    config = build_config(load_settings(name, None), {})
    assert isinstance(config, JobConfig)
    assert values and all(getattr(config, k) == v for k, v in values.items())  # every setting landed
    # The llama presets name the example's builder by import path: it loads installed or from --working-dir.
    assert config.model in BUILT_IN or config.model == "llama_example.model:build"
    # A preset sets only its own model's hyperparameters (others would be silently unused).
    others = {s.name for m in BUILT_IN if m != config.model for s in model_settings(m)}
    assert not others & set(values), (name, others & set(values))


def test_gpt_24l_is_the_gpu_peer_model_through_its_base():
    values = load_preset("gpt-24l")
    config = build_config(values, {})
    sizes = model_values(config)
    # issue 16 / notes/gpu.md: GPT 24L d2048 h16 B8 S1024 V32768 bf16
    assert (
        config.model,
        sizes["num_layers"],
        sizes["d_model"],
        sizes["num_heads"],
        sizes["seq_len"],
        sizes["vocab_size"],
        config.batch_size,
        config.dtype,
    ) == ("gpt", 24, 2048, 16, 1024, 32768, 8, "bfloat16")
    # num_heads, seq_len, vocab_size and dtype come from gpt-12l, the base it names.
    base = load_preset("gpt-12l")
    assert all(values["model_args"][k] == base["model_args"][k] for k in ("num_heads", "seq_len", "vocab_size"))
    assert values["dtype"] == base["dtype"]
    assert "num_heads" not in _raw("gpt-24l")["model_args"] and _raw("gpt-24l")["base_config"] == "gpt-12l"


def _raw(name):
    import yaml

    with open(os.path.join(config_lib.PRESETS_DIR, f"{name}.yaml")) as f:
        return yaml.safe_load(f)


def test_order_defaults_preset_config_file_flags(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("num_layers: 2\nbatch-size: 16\n")
    config = build_config(load_settings("gpt-24l", str(job), model_keys=SIZES), {"batch_size": 4, "steps": None})
    sizes = model_values(config)
    assert sizes["d_model"] == 2048  # the preset
    assert sizes["seq_len"] == 1024  # the preset's base
    assert sizes["num_layers"] == 2  # the --config file beats the preset
    assert config.batch_size == 4  # a flag beats the file
    assert config.learning_rate == JobConfig().learning_rate  # nobody set it: the default
    assert config.steps is None  # a flag not given does not override


def test_base_config_chain_is_resolved_base_first(tmp_path):
    (tmp_path / "a.yaml").write_text("base_config: b\nnum_layers: 1\n")
    (tmp_path / "b.yaml").write_text("base-config: c\nnum_layers: 2\nd_model: 64\n")
    (tmp_path / "c.yaml").write_text("model: gpt\nnum_layers: 3\nd_model: 32\nseq_len: 8\n")
    assert load_preset("a", presets_dir=str(tmp_path), model_keys=SIZES) == {
        "model": "gpt",
        "model_args": {"num_layers": 1, "d_model": 64, "seq_len": 8},
    }
    # A --config file may start from a shipped preset or from another file (relative to itself).
    (tmp_path / "job.yaml").write_text("base_config: gpt-small\nsteps: 5\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "job2.yaml").write_text("base_config: ../job.yaml\nnum_heads: 8\n")
    values = config_lib.load_yaml_overrides(str(tmp_path / "sub" / "job2.yaml"), model_keys=SIZES)
    small = load_preset("gpt-small")
    assert values == {**small, "steps": 5, "model_args": {**small["model_args"], "num_heads": 8}}


def test_a_base_config_loop_is_one_line(tmp_path):
    (tmp_path / "a.yaml").write_text("base_config: b\n")
    (tmp_path / "b.yaml").write_text("base_config: a\n")
    with pytest.raises(KitError, match=r"base_config loops \(a.yaml -> b.yaml -> a.yaml\)"):
        load_preset("a", presets_dir=str(tmp_path))


def test_unknown_preset_lists_presets_with_did_you_mean():
    with pytest.raises(KitError) as err:
        load_preset("gpt-25l")
    assert str(err.value) == (
        "--preset 'gpt-25l' is not known; use one of: gpt-12l, gpt-24l, gpt-4b, gpt-small, "
        "llama2-13b, llama2-7b, llama3-8b, llama3.2-1b, mlp-tutorial, wide-resnet-16 "
        "(did you mean gpt-24l?)"
    )
    with pytest.raises(KitError, match="--preset '../cluster/cluster' is not known"):
        load_preset("../cluster/cluster")  # only names, never paths out of the presets folder


def test_preset_with_an_unknown_key_names_the_key(tmp_path):
    (tmp_path / "bad.yaml").write_text("model: gpt\nnum_layer: 3\n")
    (tmp_path / "child.yaml").write_text("base_config: bad\n")
    with pytest.raises(KitError) as err:
        load_preset("child", presets_dir=str(tmp_path), model_keys=SIZES)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("preset bad: unknown setting 'num_layer' (did you mean num_layers?); known: model,")
    (tmp_path / "orphan.yaml").write_text("base_config: nothere\n")
    with pytest.raises(
        KitError,
        match=r"preset orphan: base_config 'nothere' is not known; use one of: bad, "
        r"child, orphan",
    ):
        load_preset("orphan", presets_dir=str(tmp_path))


def test_presets_ship_as_package_data():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["alpa_job"]
    assert "settings/presets/*.yaml" in globs
    assert set(os.listdir(config_lib.PRESETS_DIR)) == {f"{n}.yaml" for n in preset_names()}


# ----------------------------------------------------------------------------- the command line
def _cli(*args, timeout=300):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=REPO)
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "alpa_job", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def test_cli_preset_is_overridden_by_config_file_and_flags(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("d_model: 32\nseq_len: 16\nvocab_size: 64\nbatch_size: 16\n")
    proc = _cli(
        "train",
        "--preset",
        "gpt-small",
        "--config",
        str(job),
        "--num-layers",
        "1",
        "--batch-size",
        "8",
        "--num-samples",
        "16",
        "--steps",
        "1",
        "--address",
        "none",
        "--out",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = json.loads((tmp_path / "run" / "report.json").read_text())["config"]
    sizes = cfg["model_args"]
    assert cfg["model"] == "gpt" and sizes["num_heads"] == 4  # from the preset
    assert sizes["d_model"] == 32 and sizes["seq_len"] == 16  # the file beat the preset
    assert sizes["num_layers"] == 1 and cfg["batch_size"] == 8  # the flags beat both


def test_cli_unknown_preset_is_one_line_and_exit_2():
    proc = _cli("train", "--preset", "gpt-2l")
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert re.fullmatch(r"error: --preset 'gpt-2l' is not known; use one of: .*gpt-24l.* \(did you mean gpt-\d+l\?\)", lines[0]), lines[0]
