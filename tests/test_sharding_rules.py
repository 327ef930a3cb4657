"""Sharding as data: the batch's mesh axis comes from the strategy's record, as the parameters' do."""

from __future__ import annotations

import dataclasses

import pytest
from jax.sharding import PartitionSpec

from alpa_job.data import epoch_batches, synthetic
from alpa_job import strategies
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.errors import KitError
from alpa_job.models import get_model
from alpa_job.models.axes import BATCH, EMBED, MLP
from alpa_job.settings.config import JobConfig
from helpers_train import job_config


def _mlp_engine(strategy: str, mesh_shape):
    config = job_config(model="mlp", hidden_dim=16, num_samples=16, batch_size=8, steps=1, address="none", compile_cache="none").validated()
    batch, _ = next(epoch_batches(synthetic(config), 8, "drop", 0, 0))
    return JaxEngine(config, get_model(config), batch, strategy, mesh_shape)


@pytest.mark.parametrize("strategy", sorted(strategies.STRATEGIES))
def test_every_strategy_splits_the_batch_over_data(strategy):
    # two-level strategies (hsdp) split it over the data axis across hosts and their axis within a host too
    assert "data" in strategies.axes_of(strategies.batch_mesh_axis(strategies.get(strategy).param_rules))


def test_rules_without_a_batch_rule_are_refused_naming_the_fix():
    with pytest.raises(KitError, match=r"without a \('batch', mesh axis\) rule.*add one"):
        strategies.batch_mesh_axis([(EMBED, "data")])


def test_the_engine_reads_the_batch_rule(monkeypatch):
    # A strategy whose rules put the batch on "model": the engine's batch sharding must follow the data.
    monkeypatch.setitem(
        strategies.STRATEGIES, "tensor", dataclasses.replace(strategies.TENSOR, param_rules=[(BATCH, "model"), (MLP, "data")])
    )
    engine = _mlp_engine("tensor", (2, 4))
    assert engine.batch_sharding.spec == PartitionSpec("model")
    assert _mlp_engine("data", (8, 1)).batch_sharding.spec == PartitionSpec("data")


def test_tensor_keeps_its_default_model_axis_inside_one_process():
    """Each process reads only its own batch rows, so tensor's default model axis divides one process's
    devices: 3 hosts x 2 GPUs get 3x2 (2x3 would need rows another process read); one process keeps the
    largest of 4, 3, 2 that divides all its devices; an explicit --model-parallel is taken as given."""

    def mesh_shape_for(name, devices, model_parallel=0, devices_per_process=None):
        return strategies.get(name).mesh_shape(devices, model_parallel, devices_per_process)

    assert mesh_shape_for("tensor", 6) == (2, 3)
    assert mesh_shape_for("tensor", 6, devices_per_process=2) == (3, 2)
    assert mesh_shape_for("tensor", 16, devices_per_process=8) == (4, 4)
    assert mesh_shape_for("tensor", 12, devices_per_process=6) == (4, 3)
    assert mesh_shape_for("tensor", 4, devices_per_process=1) == (4, 1)  # one device a process: no model axis
    assert mesh_shape_for("tensor", 6, model_parallel=3, devices_per_process=2) == (2, 3)
    assert mesh_shape_for("fsdp", 6, devices_per_process=2) == (6, 1)


def test_the_driver_refuses_a_tensor_model_axis_across_processes_before_any_actor():
    """The cluster check (settings/validate.py, import-free) applies the engine's rule first: 3 nodes x 2
    devices with --model-parallel 3 is refused naming the fix; the default and other strategies pass,
    nodes with unequal device counts included."""
    from alpa_job.settings.validate import check_divisibility

    def config(batch_size=96, **overrides):
        return JobConfig(model="mlp", batch_size=batch_size, steps=1, address="none", **overrides).validated()

    with pytest.raises(
        KitError,
        match=r"data-parallel size 2 does not give each of the 3 processes its own rows.*"
        r"--model-parallel that divides one process's 2 devices",
    ):
        check_divisibility(config(strategy="tensor", model_parallel=3), 6, devices_per_process=2)
    check_divisibility(config(strategy="tensor"), 6, devices_per_process=2)  # default: 3x2
    check_divisibility(config(strategy="data", batch_size=100), 5, devices_per_process=2)  # nodes of 2, 2 and 1


def test_no_jax_strategy_is_special_cased_by_name_outside_its_record():
    """A strategy is one record (alpa_job/strategies.py) that every reader takes: a branch on a JAX strategy's
    name anywhere else would be a second definition (the Alpa engine's own strategy names are its own)."""
    import os
    import re

    package = os.path.dirname(strategies.__file__)
    names = "|".join(strategies.STRATEGIES)
    branch = re.compile(rf"strategy\)? *(==|!=|in|not in) *\(?\"({names})\"|\"({names})\" *(==|!=|in) ")
    found = []
    for root, _dirs, files in os.walk(package):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or path in (strategies.__file__, os.path.join(package, "engines", "alpa_engine.py")):
                continue
            found += [
                f"{os.path.relpath(path, package)}:{n}: {line.strip()}" for n, line in enumerate(open(path), 1) if branch.search(line)
            ]
    assert found == [], "\n".join(found)
    assert re.search(branch, 'if config.strategy == "tensor":')  # the check sees the shape it forbids
