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
from alpa_job.settings import catalog
from alpa_job.settings.config import JobConfig, build_config, coerce, load_yaml_overrides
from alpa_job.settings.setting import GROUPS, Setting, plain_type

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- coercion of file values
@pytest.mark.parametrize("hint, value, expected", [
    (int, "12", 12), (int, 16.0, 16), (int, 3, 3),
    (float, 8, 8.0), (float, "1e-3", 1e-3),
    (str, 123, "123"), (str, "runs/a", "runs/a"),
    (bool, "yes", True), (bool, "off", False), (bool, 1, True), (bool, True, True),
    (Optional[int], None, None), (Optional[int], "5", 5), (Optional[float], 2, 2.0), (Optional[str], 7, "7"),
])
def test_coercion_of_each_type(hint, value, expected):
    got = coerce("x", value, hint)
    assert got == expected and type(got) is type(expected)


def test_coercion_reads_jobconfigs_real_type_hints():
    hints = typing.get_type_hints(JobConfig)
    assert hints["steps"] == Optional[int] and hints["learning_rate"] is float and hints["resume"] is bool
    assert {plain_type(h) for h in hints.values()} <= {int, float, str, bool}
    config = build_config({"batch_size": "32", "learning_rate": 1, "resume": "false", "steps": 4.0,
                           "restart_wait": "0"}, {})
    assert (config.batch_size, config.learning_rate, config.resume, config.steps) == (32, 1.0, False, 4)
    assert type(config.learning_rate) is float and type(config.steps) is int


@pytest.mark.parametrize("text, message", [
    ("steps: abc\n", "setting steps: 'abc' is not a valid int"),
    ("batch-size: 2.5\n", "setting batch_size: 2.5 is not a valid int"),
    ("learning_rate: fast\n", "setting learning_rate: 'fast' is not a valid float"),
])
def test_a_wrong_type_in_yaml_is_one_line_naming_the_key_and_the_type(tmp_path, text, message):
    job = tmp_path / "job.yaml"
    job.write_text(text)
    with pytest.raises(KitError) as err:
        build_config(load_yaml_overrides(str(job)), {})
    assert str(err.value) == message and "\n" not in str(err.value)
