"""Two-level meshes: `hsdp` shards the state over one host's devices and replicates it across hosts, so
its per-layer gathers and reduce-scatters stay on the host's links and only the gradients' reduction
crosses the network. Eight emulated CPU devices stand for two hosts of four (the mesh's rows are hosts)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from alpa_job import strategies
from alpa_job.data import epoch_batches, synthetic
from alpa_job.errors import KitError
from alpa_job.record import traffic
from helpers_train import tiny_config

TWO_HOSTS_OF_FOUR = [d // 4 for d in range(8)]  # device -> host on a (2, 4) mesh, rows being hosts


def test_hsdp_mesh_is_hosts_by_their_devices():
    hsdp = strategies.get("hsdp")
    assert hsdp.mesh_shape(6, devices_per_process=2) == (3, 2)
    assert hsdp.mesh_shape(16, devices_per_process=8) == (2, 8)
    assert hsdp.mesh_shape(8) == (1, 8)  # one host: fsdp over its devices
    assert hsdp.batch_ways((3, 2)) == 6  # the batch splits over both levels
    with pytest.raises(KitError, match="same number of devices on every host"):
        hsdp.mesh_shape(5, devices_per_process=2)
    # auto and the planner try it only where it differs from a flat mesh
    assert hsdp.candidate_meshes(6, 2) == [(3, 2)]
    assert hsdp.candidate_meshes(8, 8) == [] and hsdp.candidate_meshes(4, 1) == []
    assert ("hsdp", (3, 2)) in strategies.auto_candidates(6, 2)
    assert strategies.data_axis_size("hsdp", 6, devices_per_process=2) == 6
    # pipeline stages only across hosts (a stage a host, one host per process here), also of one device each
    pipeline = strategies.get("pipeline")
    assert pipeline.candidate_meshes(6, 2) == [(3, 2)] and pipeline.candidate_meshes(4, 1) == [(4, 1)]
    assert pipeline.candidate_meshes(8, 8) == [] and pipeline.candidate_meshes(8) == []


@pytest.fixture(scope="module")
def engines():
    """{strategy: (engine, its per-step losses over 5 steps)}: GPT on one global batch, 8 devices."""
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.models import get_model

    config = tiny_config("gpt", compile_cache="none")
    model = get_model(config)
    batches = [b for b, _ in epoch_batches(synthetic(config), 16, "drop", 0, 0)]
    out = {}
    runs = [(name, name, mesh, config) for name, mesh in (("data", (8, 1)), ("fsdp", (8, 1)), ("hsdp", (2, 4)))]
    runs.append(("hsdp per layer", "hsdp", (2, 4), config.replace(fsdp_gather="layer")))
    for name, strategy, mesh, run_config in runs:
        engine = JaxEngine(run_config, model, batches[0], strategy, mesh)
        engine.compile()
        state, losses = engine.init_state(0), []
        for step in range(5):
            state, loss = engine.step(state, engine.put_batch(batches[step % len(batches)]))
            losses.append(float(loss))
        out[name] = (engine, losses)
    return out


def test_hsdp_computes_the_losses_data_does(engines):
    _, data = engines["data"]
    _, hsdp = engines["hsdp"]
    np.testing.assert_allclose(hsdp, data, rtol=1e-5)
    assert data[-1] < data[0]  # it trained


def test_hsdp_gathers_per_layer_within_each_host(engines):
    """--fsdp-gather layer under hsdp: the same losses, each block's weights gathered in the forward and again
    in the backward, and none of those gathers crosses a host."""
    engine, losses = engines["hsdp per layer"]
    np.testing.assert_allclose(losses, engines["data"][1], rtol=1e-5)
    layers = engine.config.model_args["num_layers"]
    assert engine.extra_report()["weight_gather"] == {"placement": "per layer", "layers": layers}
    rows = traffic.step_traffic(engine.stats.hlo_texts[0], 8, 4, TWO_HOSTS_OF_FOUR)
    gathers = [r for r in rows if r.kind == "all-gather"]
    xla_gathers = [
        r for r in traffic.step_traffic(engines["hsdp"][0].stats.hlo_texts[0], 8, 4, TWO_HOSTS_OF_FOUR) if r.kind == "all-gather"
    ]
    assert sum(r.output_bytes for r in gathers) > 1.5 * sum(r.output_bytes for r in xla_gathers)
    assert not any(r.network_bytes for r in gathers)


def test_hsdp_splits_the_state_within_a_host_and_replicates_it_across(engines):
    engine, _ = engines["hsdp"]
    assert engine.mesh.axis_names == ("data", "fsdp") and engine.mesh.devices.shape == (2, 4)
    specs = [s.spec for s in jax.tree_util.tree_leaves(engine.state_sharding.params)]
    used = {axis for spec in specs for entry in spec if entry for axis in strategies.axes_of(entry)}
    assert used == {"fsdp"}  # parameters split over a host's devices only, never across hosts
    assert engine.batch_sharding.spec == PartitionSpec(("data", "fsdp"))
    assert engine.plan().leaf_records()  # the plan reads a two-axis mesh with its own names


def test_hsdp_on_two_hosts_sends_less_across_than_fsdp(engines):
    def on_two_hosts(name):
        engine, _ = engines[name]
        rows = traffic.step_traffic(engine.stats.hlo_texts[0], 8, 4, TWO_HOSTS_OF_FOUR)
        return rows, traffic.summary(rows)

    fsdp_rows, fsdp = on_two_hosts("fsdp")
    hsdp_rows, hsdp = on_two_hosts("hsdp")
    assert fsdp["collectives_across_hosts"] == fsdp["collectives"] > 0
    # hsdp: the gathers and reduce-scatters stay inside each host; some collective still crosses (the
    # gradients' reduction between the two hosts' replicas), with fewer bytes than fsdp's.
    assert 0 < hsdp["collectives_across_hosts"] < hsdp["collectives"]
    assert 0 < hsdp["across_hosts_bytes"] < fsdp["across_hosts_bytes"]
    assert not any(r.network_bytes for r in hsdp_rows if r.kind == "all-gather")
