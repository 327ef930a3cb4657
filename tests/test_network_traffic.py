"""What a train step sends within a host and across hosts, read from its compiled HLO (record/traffic.py):
the bytes each collective's replica groups put on the network for a given host layout, in the report."""

from __future__ import annotations

import pytest

from alpa_job.data import epoch_batches, synthetic
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.models import get_model
from alpa_job.record import traffic
from helpers_train import job_config


@pytest.fixture(scope="module")
def compiled():
    """{strategy: (engine, its train step's HLO)} for the MLP on 8 emulated devices."""
    config = job_config(
        model="mlp", hidden_dim=64, num_samples=32, batch_size=16, steps=1, address="none", compile_cache="none"
    ).validated()
    batch, _ = next(epoch_batches(synthetic(config), 16, "drop", 0, 0))
    out = {}
    for strategy, mesh in (("fsdp", (8, 1)), ("tensor", (4, 2))):
        engine = JaxEngine(config, get_model(config), batch, strategy, mesh)
        engine.compile()
        out[strategy] = (engine, engine.stats.hlo_texts[0])
    return out


def _on_hosts(hlo: str, node_of):
    return traffic.summary(traffic.step_traffic(hlo, len(node_of), 1, node_of))


def test_one_host_sends_nothing_across_and_the_report_says_so(compiled):
    engine, _ = compiled["fsdp"]
    network = engine.network_traffic()
    assert network["hosts"] == 1 and network["across_hosts_bytes"] == 0 and network["collectives_across_hosts"] == 0
    assert network["within_host_bytes"] > 0 and network["collectives"] > 0 and network["groups_read"]
    assert engine.extra_report()["network_traffic"] == network


def test_fsdp_over_two_hosts_crosses_with_every_collective(compiled):
    _, hlo = compiled["fsdp"]
    one_host = _on_hosts(hlo, [0] * 8)
    two_hosts = _on_hosts(hlo, [d // 4 for d in range(8)])
    every_device_a_host = _on_hosts(hlo, list(range(8)))
    # fsdp's gathers and reduce-scatters span all 8 devices: each one crosses once there are two hosts.
    assert two_hosts["collectives_across_hosts"] == two_hosts["collectives"] > 0
    assert 0 < two_hosts["across_hosts_bytes"] < every_device_a_host["across_hosts_bytes"]
    assert every_device_a_host["within_host_bytes"] == 0
    # Ring traffic per device is the same bytes, only split differently between the two links.
    assert two_hosts["within_host_bytes"] < one_host["within_host_bytes"]


def test_tensor_on_two_hosts_sends_across_only_the_axis_the_hosts_split(compiled):
    """Mesh (data 4, model 2), position p = 2 * data + model, two hosts of four devices. Hosts that each hold
    two model pairs (p // 4) keep every model-axis collective (groups of 2) inside and cross with the data
    axis's (groups of 4); hosts that each hold one model column (p % 2) do the opposite."""
    _, hlo = compiled["tensor"]

    def crossing(node_of):
        rows = traffic.step_traffic(hlo, 8, 4, node_of)
        by_size = {}
        for row in rows:
            by_size.setdefault(row.group_size, []).append(row.network_bytes > 0)
        return by_size

    pairs_inside = crossing([p // 4 for p in range(8)])
    columns_inside = crossing([p % 2 for p in range(8)])
    assert pairs_inside.get(2) and not any(pairs_inside[2]) and pairs_inside.get(4) and all(pairs_inside[4])
    assert all(columns_inside[2]) and not any(columns_inside[4])


def test_the_report_line_names_both_links():
    from alpa_job.inspect.render import network_text

    line = network_text(
        {
            "hosts": 2,
            "within_host_bytes": 3 * 2**20,
            "across_hosts_bytes": 2**30,
            "collectives": 4,
            "collectives_across_hosts": 3,
            "groups_read": True,
        }
    )
    assert line.startswith("1.0 GiB across hosts (3 of 4 collectives cross, 2 host(s)), 3.0 MiB within"), line
