"""The core training loop on emulated CPU devices, in-process (no Ray): models, strategies,
fixed-shape batching, auto search, checkpoints."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from alpa_job.launch.runner import run_in_process
from helpers_train import tiny_config


def _row(result, path):
    return next(r for r in result.params if r.path == path)


@pytest.mark.parametrize("model", ["mlp", "wide_resnet", "gpt"])
def test_each_model_loss_falls_on_synthetic_data(model):
    result = run_in_process(tiny_config(model, steps=12, epochs=100))
    losses = result.losses
    assert len(losses) == 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert result.compiles == 1
    assert result.devices.count == 8


def test_data_strategy_keeps_parameters_whole_with_the_replicated_update_and_split_with_the_sharded_one():
    result = run_in_process(tiny_config("mlp", steps=1, strategy="data", data_update="replicated"))
    params = [r for r in result.params if r.path.startswith("params/")]
    assert params and {r.strategy for r in params} == {"DP"}
    assert all(r.bytes_per_device == r.bytes for r in params)
    assert (result.mesh.shape, result.mesh.axes) == ([8, 1], ["data", "model"])
    sharded = run_in_process(tiny_config("mlp", steps=1, strategy="data"))  # the default update
    params = [r for r in sharded.params if r.path.startswith("params/")]
    assert {r.strategy for r in params} == {"ZeRO"}  # split over the data axis between steps
    assert all(r.bytes_per_device == r.bytes // 8 for r in params)


def test_tensor_strategy_splits_first_mlp_kernel_on_output_dim():
    result = run_in_process(tiny_config("mlp", steps=1, strategy="tensor", model_parallel=4))
    assert result.mesh.shape == [2, 4]
    first = _row(result, "params/Dense_0/kernel")
    assert first.split_axes == [[], ["model"]]  # [in, out]: output dim over the model axis
    assert first.strategy == "MP"
    assert first.bytes_per_device == first.bytes // 4
    second = _row(result, "params/Dense_1/kernel")  # row-parallel partner: input dim split
    assert second.split_axes == [["model"], []] and second.strategy == "MP"
    # The optimizer moments follow their parameter.
    assert _row(result, "opt_state/0/mu/Dense_0/kernel").strategy == "MP"


def test_fsdp_parameters_and_optimizer_state_are_zero():
    result = run_in_process(tiny_config("mlp", steps=1, strategy="fsdp"))
    for prefix in ("params/", "opt_state/0/mu/", "opt_state/0/nu/"):
        rows = [r for r in result.params if r.path.startswith(prefix)]
        assert rows and {r.strategy for r in rows} == {"ZeRO"}, prefix
        assert all(r.bytes_per_device * 8 == r.bytes for r in rows)


@pytest.mark.parametrize("policy, steps_per_epoch, seen, dropped", [("drop", 3, 48, 4), ("pad", 4, 52, 0)])
def test_ragged_epochs_compile_once(policy, steps_per_epoch, seen, dropped):
    epochs = 3
    result = run_in_process(tiny_config("mlp", num_samples=52, epochs=epochs, remainder=policy))
    assert result.steps == steps_per_epoch * epochs
    assert result.samples_seen == seen * epochs
    assert result.samples_dropped == dropped * epochs
    assert result.compiles == 1
    assert result.backend_compiles_during_loop == 0  # XLA itself saw no new shape


def test_padded_rows_do_not_change_the_loss():
    """A padded batch trains exactly like the same real rows alone (mask weights them to zero)."""
    from alpa_job.data import epoch_batches, synthetic
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.models import get_model

    config = tiny_config("mlp")
    model = get_model(config)
    batch, _ = next(epoch_batches(synthetic(config), 16, "pad", 0, 0))
    engine = JaxEngine(config, model, batch, "data", (8, 1))
    engine.compile()
    padded = dict(batch)
    padded["mask"] = np.concatenate([np.ones(8, np.float32), np.zeros(8, np.float32)])
    padded["x"] = np.concatenate([batch["x"][:8], np.full_like(batch["x"][8:], 123.0)])
    twin = dict(padded, x=np.concatenate([batch["x"][:8], np.zeros_like(batch["x"][8:])]))
    _, loss_a = engine.step(engine.init_state(0), engine.put_batch(padded))
    _, loss_b = engine.step(engine.init_state(0), engine.put_batch(twin))
    assert float(loss_a) == pytest.approx(float(loss_b), rel=1e-6)


def test_auto_measures_candidates_and_keeps_the_fastest():
    result = run_in_process(tiny_config("mlp", steps=2, strategy="auto", auto_trial_steps=2))
    table = result.search
    timed = [r for r in table if r.step_time_s]
    assert len(timed) >= 3
    chosen = [r for r in table if r.chosen]
    assert len(chosen) == 1
    assert chosen[0].step_time_s == min(r.step_time_s for r in timed)
    assert result.strategy == chosen[0].strategy
    assert result.mesh.shape == chosen[0].mesh_shape
    assert result.compiles == 1  # the winner's compile is reused for training


def test_auto_compiles_the_first_candidate_alone_on_gpus_only():
    """GPUs: the first candidate compiles alone (its autotuning then serves the rest), the rest together;
    CPU devices (nothing to autotune): all together. --auto-compile-workers 1 stays one at a time."""
    from alpa_job.engines.auto_search import compile_schedule

    three = ["data", "fsdp", "tensor"]
    assert compile_schedule(three, 3, "gpu") == [(["data"], 1), (["fsdp", "tensor"], 3)]
    assert compile_schedule(three, 3, "cpu") == [(three, 3)]
    assert compile_schedule(three, 1, "gpu") == [(three, 1)]
    assert compile_schedule(["data"], 3, "gpu") == [(["data"], 3)]


def test_a_candidate_lowered_ahead_compiles_and_trains_the_same():
    """auto lowers the next candidates while the first compiles: compile_step then only compiles, and the
    step it gives trains the same numbers as one traced, lowered and compiled in one go."""
    from alpa_job.data import epoch_batches, synthetic
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.models import get_model

    config = tiny_config("mlp")
    model = get_model(config)
    batch, _ = next(epoch_batches(synthetic(config), 16, "pad", 0, 0))
    losses = []
    for ahead in (False, True):
        engine = JaxEngine(config, model, batch, "fsdp", (8, 1))
        if ahead:
            engine.lower_step()
            assert engine._lowered_ahead is not None
        stats = engine.compile_step()
        assert stats.compile_seconds > 0 and stats.flops_per_step
        _, loss = engine.step(engine.init_state(0), engine.put_batch(batch))
        losses.append(float(loss))
    assert engine._lowered_ahead is None and losses[0] == losses[1]


def test_auto_skips_candidates_over_the_memory_budget():
    from alpa_job.errors import KitError

    config = tiny_config("mlp", hidden_dim=256, steps=1, strategy="auto", auto_trial_steps=1)
    peaks = [r.peak_bytes_per_device for r in run_in_process(config).search]
    budget = (min(peaks) + max(peaks)) / 2  # fsdp/tensor shard the state; data replicates it
    assert min(peaks) < budget < max(peaks)
    table = run_in_process(config.replace(memory_limit_gb=budget / 1e9)).search
    for row in table:
        if row.peak_bytes_per_device is None:  # its state alone was over the budget: dropped before compiling
            assert row.fits is False and "state alone" in row.note
        else:
            assert row.fits == (row.peak_bytes_per_device <= budget)
        if not row.fits:
            assert row.step_time_s is None and not row.chosen and "budget" in row.note
    with pytest.raises(KitError, match="no candidate fits"):
        run_in_process(config.replace(memory_limit_gb=1e-9))


def test_checkpoint_round_trips_exactly(tmp_path):
    from alpa_job.train.checkpoint import Checkpointer

    config = tiny_config("mlp", steps=4, checkpoint_every=2, out=str(tmp_path))
    result = run_in_process(config, return_state=True)
    state = result.final_state
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), 2)
    assert ckpt.latest_step() == 4
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    restored, data_state = ckpt.restore(abstract)  # the input stream's position is saved beside the state
    ckpt.close()
    assert data_state["grain"]["next_index"] == 4
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding


def test_resume_continues_to_the_same_result(tmp_path):
    straight = run_in_process(tiny_config("mlp", steps=6, epochs=10, out=str(tmp_path / "a")), return_state=True)
    run_in_process(tiny_config("mlp", steps=4, epochs=10, checkpoint_every=2, out=str(tmp_path / "b")))
    resumed = run_in_process(
        tiny_config("mlp", steps=6, epochs=10, checkpoint_every=2, resume=True, out=str(tmp_path / "b")), return_state=True
    )
    assert resumed.resumed_from_step == 4 and resumed.steps == 2
    assert resumed.losses == straight.losses[4:]
    for a, b in zip(jax.tree_util.tree_leaves(straight.final_state.params), jax.tree_util.tree_leaves(resumed.final_state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_compute_keeps_float32_parameters():
    result = run_in_process(tiny_config("mlp", steps=8, epochs=10, dtype="bfloat16"))
    assert np.mean(result.losses[-2:]) < np.mean(result.losses[:2])
    assert {r.dtype for r in result.params if r.path.startswith("params/")} == {"float32"}


def test_a_saved_search_is_reused_only_when_every_process_saved_the_same_winner():
    from alpa_job.engines.auto_search import _chosen_index, agreed_winner

    candidates = [("data", (8, 1)), ("fsdp", (8, 1)), ("tensor", (4, 2))]
    table = [{"strategy": "fsdp", "mesh_shape": [8, 1], "chosen": True}, {"strategy": "data", "mesh_shape": [8, 1], "chosen": False}]
    assert _chosen_index(candidates, table) == 1
    assert _chosen_index(candidates, None) == -1  # no saved search on this process
    assert _chosen_index(candidates[:1], table) == -1  # its winner is no longer a candidate
    assert agreed_winner([1, 1, 1]) == 1
    assert agreed_winner([1, 1, -1]) is None  # a node without the table: every process searches
    assert agreed_winner([1, 2, 1]) is None  # two tables that chose differently
    assert agreed_winner([-1, -1]) is None
