"""The settings catalogue is the one list: JobConfig's fields, the train flags and their --help, the
coercion of file values (from JobConfig's real type hints) and the checks all come from it, and a
model's own sizes come from the model's jax-free declaration."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import subprocess
import sys
import typing
from typing import Optional

import pytest

from alpa_job.errors import KitError
from alpa_job.models import size_settings
from alpa_job.settings import catalog
from alpa_job.settings.config import JobConfig, build_config, coerce, load_yaml_overrides
from alpa_job.setting import GROUPS, ModelArgs, Setting, plain_type

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- coercion of file values
@pytest.mark.parametrize(
    "hint, value, expected",
    [
        (int, "12", 12),
        (int, 16.0, 16),
        (int, 3, 3),
        (float, 8, 8.0),
        (float, "1e-3", 1e-3),
        (str, 123, "123"),
        (str, "runs/a", "runs/a"),
        (bool, "yes", True),
        (bool, "off", False),
        (bool, 1, True),
        (bool, True, True),
        (Optional[int], None, None),
        (Optional[int], "5", 5),
        (Optional[float], 2, 2.0),
        (Optional[str], 7, "7"),
    ],
)
def test_coercion_of_each_type(hint, value, expected):
    got = coerce("x", value, hint)
    assert got == expected and type(got) is type(expected)


def test_coercion_reads_jobconfigs_real_type_hints():
    hints = typing.get_type_hints(JobConfig)
    assert hints["steps"] == Optional[int] and hints["learning_rate"] is float and hints["resume"] is bool
    assert {plain_type(h) for h in hints.values()} <= {int, float, str, bool, ModelArgs}
    config = build_config({"batch_size": "32", "learning_rate": 1, "resume": "false", "steps": 4.0, "restart_wait": "0"}, {})
    assert (config.batch_size, config.learning_rate, config.resume, config.steps) == (32, 1.0, False, 4)
    assert type(config.learning_rate) is float and type(config.steps) is int


@pytest.mark.parametrize(
    "text, message",
    [
        ("steps: abc\n", "setting steps: 'abc' is not a valid int"),
        ("batch-size: 2.5\n", "setting batch_size: 2.5 is not a valid int"),
        ("learning_rate: fast\n", "setting learning_rate: 'fast' is not a valid float"),
    ],
)
def test_a_wrong_type_in_yaml_is_one_line_naming_the_key_and_the_type(tmp_path, text, message):
    job = tmp_path / "job.yaml"
    job.write_text(text)
    with pytest.raises(KitError) as err:
        build_config(load_yaml_overrides(str(job)), {})
    assert str(err.value) == message and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- one list
def _train_parser() -> argparse.ArgumentParser:
    from alpa_job.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command")
    return commands.choices["train"]


CLI_ONLY = {"help", "preset", "config", "progress_every", "verbose", "quiet"}  # not job settings


def test_every_jobconfig_field_is_one_catalogue_entry_and_one_flag():
    fields = [f.name for f in dataclasses.fields(JobConfig)]
    assert fields == [s.name for s in catalog.SETTINGS] == list(catalog.FIELD_NAMES)
    defaults = JobConfig()  # a mapping's default is made per instance (default_factory)
    assert all(getattr(defaults, f.name) == catalog.setting(f.name).default for f in dataclasses.fields(JobConfig))
    actions = [a for a in _train_parser()._actions if a.option_strings]
    by_dest = {}
    for action in actions:
        by_dest.setdefault(action.dest, []).extend(action.option_strings)
    sizes = {s.name for s in size_settings()}  # the built-ins' sizes: --model-arg spelled as flags of their own
    assert set(by_dest) == set(fields) | CLI_ONLY | sizes and not sizes & set(fields)
    for s in catalog.SETTINGS:
        expected = [w.flag for w in s.switches] if s.switches else [s.flag]
        assert by_dest[s.name] == expected, s.name


def test_jobconfig_is_a_frozen_picklable_dataclass():
    config = JobConfig(model="gpt", model_args={"num_layers": 3})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model = "mlp"
    assert pickle.loads(pickle.dumps(config)) == config  # it crosses to Ray actors
    assert list(config.as_dict())[:3] == ["model", "dataset", "data_dir"]
    assert config.replace(steps=2).steps == 2
    with pytest.raises(KitError, match="--steps must be a positive integer"):
        config.replace(steps=0)


def test_each_model_declares_its_own_settings():
    from alpa_job.models import BUILT_IN, builder_of, model_settings, model_values

    fields = {name: tuple(s.name for s in model_settings(name)) for name in BUILT_IN}
    assert fields == {
        "mlp": ("hidden_dim",),
        "wide_resnet": ("depth", "width"),
        "gpt": ("num_layers", "d_model", "num_heads", "seq_len", "vocab_size", "remat"),
    }
    assert [(s.model, s.name) for s in size_settings()] == [(n, f) for n in BUILT_IN for f in fields[n]]
    for name in BUILT_IN:
        declared = model_settings(name)
        assert all(s.__module__ == "alpa_job.setting" for s in map(type, declared))
    for name in BUILT_IN:  # the builder reads the same declaration
        declared = builder_of(name).declaration
        assert declared.names == fields[name]
        defaults = model_values(JobConfig(model=name))
        assert all(s.default == defaults[s.name] for s in declared.settings)


def _help_groups() -> dict:
    """--help's groups -> their option lines, from the text a user reads."""
    text = _train_parser().format_help()
    groups, current = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = groups.setdefault(line[:-1], [])
        elif current is not None and line.startswith("  -"):
            current.append(line.strip())
    return groups, text


def test_a_models_settings_appear_in_help_under_its_group_with_its_name():
    groups, text = _help_groups()
    assert list(groups)[:6] == ["options", "settings files", *GROUPS]
    for s in catalog.SETTINGS:
        lines = groups[s.group]
        assert any(line.startswith(s.switches[0].flag if s.switches else s.flag) for line in lines), s.name
    # A model's sizes: under "model and data", their help starting with the model's name.
    flat = " ".join(text.split())
    assert "--hidden-dim N mlp: width (layers 4h -> h -> 4h -> h) (default: 256)" in flat
    assert "--num-heads N gpt: attention heads (divide --d-model) (default: 4)" in flat
    assert "--depth N wide_resnet: 6n+4 (default: 10)" in flat


def test_help_and_the_checks_before_ray_import_no_engine():
    code = (
        "import sys, contextlib, io\n"
        "from alpa_job.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['train', '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "from alpa_job.settings.config import build_config\n"
        "from alpa_job.models import model_values\n"
        "model_values(build_config({'model': 'gpt', 'model_args': {'num_heads': 2}}, {}))\n"
        "print(sorted(m for m in ('jax', 'flax', 'ray') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_setting_is_checked_when_declared():
    with pytest.raises(ValueError, match="type"):
        Setting("sizes", list, [], "a list is no flag")
    with pytest.raises(ValueError, match="check"):
        Setting("n", int, 1, "n", check="even")
    with pytest.raises(ValueError, match="group"):
        Setting("n", int, 1, "n", group="misc")
    assert Setting("memory_gb", Optional[float], None, "x").flag == "--memory-gb"


def test_the_step_stores_key_and_the_alpa_plan_key_read_the_catalogue():
    # Where a run writes, when it stops and how it restarts never reach the compiled step; a model
    # size always does: the step store and the Alpa plan cache take both facts from the catalogue.
    from alpa_job.engines import executable_store, plan_cache

    assert set(executable_store.NOT_IN_STEP) == {s.name for s in catalog.SETTINGS if not s.decides_step}
    assert {"out", "resume", "max_restarts", "seed", "steps"} <= set(executable_store.NOT_IN_STEP)
    assert {"model", "model_args", "strategy", "dtype", "batch_size", "learning_rate"}.isdisjoint(executable_store.NOT_IN_STEP)
    assert set(plan_cache.MODEL_FIELDS) == {"model", "model_args", "dtype"}
