"""`doctor --network`: the link probe's schedule, its two ends over real sockets, and the verdicts."""

from __future__ import annotations

import itertools

import pytest

from alpa_job.cluster.doctor import links, network


@pytest.mark.parametrize("count", [2, 3, 4, 5, 8])
def test_rounds_cover_every_pair_once_and_no_node_twice_in_a_round(count):
    nodes = ["10.0.0.%d" % i for i in range(count)]
    rounds = network.round_robin(nodes)
    pairs = [frozenset(p) for r in rounds for p in r]
    assert sorted(map(sorted, pairs)) == sorted(map(sorted, map(frozenset, itertools.combinations(nodes, 2))))
    assert all(len({n for p in r for n in p}) == 2 * len(r) for r in rounds)
    assert len(rounds) == (count - 1 if count % 2 == 0 else count)


def test_a_stream_over_loopback_is_timed_by_the_receiver():
    receiver = links.LinkReceiver("127.0.0.1", (40000, 49999), hold_s=30)
    try:
        assert 40000 <= receiver.port <= 49999
        sent = links.send_stream("127.0.0.2", "127.0.0.1", receiver.port, 0.3, 2.0)
        assert sent.get("error") is None and sent["rtt_ms"] > 0 and sent["sent_bytes"] > 0, sent
        got = receiver.take("127.0.0.2")  # known by the sender's own address
        assert got["bytes"] == sent["sent_bytes"] and got["seconds"] > 0, got
        row = network.link_row("127.0.0.2", "127.0.0.1", sent, got, None)
        assert row["gbps"] > 0.1 and row["error"] is None
    finally:
        receiver.close()


def test_a_closed_port_is_an_error_row_not_a_wait():
    sock = links.bind_in_range("127.0.0.1", 40000, 49999)
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    sent = links.send_stream("127.0.0.1", "127.0.0.1", port, 0.2, 1.0)
    assert "connect 127.0.0.1:%d" % port in sent["error"]
    row = network.link_row("a", "b", sent, None, None)
    assert row["gbps"] is None and row["error"] == sent["error"]


def _rows(rates):
    return [{"src": s, "dst": d, "gbps": g, "rtt_ms": 0.1, "error": None} for (s, d), g in rates.items()]


def test_a_host_whose_every_outgoing_link_is_slow_is_named_once():
    rows = _rows({("h", "w1"): 9.0, ("w1", "h"): 9.4, ("h", "w2"): 8.8, ("w2", "h"): 0.05, ("w1", "w2"): 9.1, ("w2", "w1"): 0.048})
    failed = [c for c in network.verdicts(rows) if not c["ok"]]
    named = [c for c in failed if c["node"] == "w2" and "every link from w2 is slow" in c["detail"]]
    assert len(named) == 1 and "h 0.05 Gb/s" in named[0]["detail"] and "tc qdisc" in named[0]["fix"], failed
    assert not [c for c in failed if c["detail"].startswith("link ")]  # the host explains both links
    assert failed[-1]["node"] is None and "6 link(s) measured" in failed[-1]["detail"]


def test_one_slow_link_is_named_by_its_ends():
    rows = _rows({("h", "w1"): 9.0, ("w1", "h"): 9.4, ("h", "w2"): 8.8, ("w2", "h"): 9.2, ("w1", "w2"): 0.5, ("w2", "w1"): 9.3})
    failed = [c for c in network.verdicts(rows) if not c["ok"]]
    assert [c["detail"].split(" (")[0] for c in failed[:-1]] == ["link w1 -> w2 at 0.5 Gb/s"]


def test_even_links_give_one_green_line_and_two_nodes_compare_with_the_declared_bandwidth():
    even = network.verdicts(_rows({("a", "b"): 9.0, ("b", "a"): 9.4, ("a", "c"): 8.8, ("c", "a"): 9.2}))
    assert [c["ok"] for c in even] == [True]
    two = _rows({("a", "b"): 0.9, ("b", "a"): 3.5})
    assert all(c["ok"] for c in network.verdicts(two))  # nothing to compare with
    failed = [c for c in network.verdicts(two, declared_gbps=10) if not c["ok"]]  # below a quarter of it
    assert any("link a -> b at 0.9 Gb/s (declared 10 Gb/s)" in c["detail"] for c in failed), failed


def test_a_stream_that_failed_names_both_ends_and_the_firewall():
    rows = [{"src": "a", "dst": "b", "gbps": None, "rtt_ms": None, "error": "connect b:41000: Connection refused"}]
    (c,) = network.verdicts(rows)
    assert not c["ok"] and "no stream a -> b" in c["detail"] and "alpa_job.cluster.firewall" in c["fix"]


def test_nccl_lines_of_the_all_reduce_become_per_node_checks():
    """The real socket-only log of two H200 processes, as the probe on one node would have kept it."""
    from pathlib import Path

    from alpa_job.cluster import network_probe
    from alpa_job.cluster.doctor import collective

    lines = (Path(__file__).parent / "data" / "nccl" / "sockets-two-hosts.log").read_text().splitlines()
    result = {"backend": "gpu", "devices": 2, "bytes": 32 << 20, "seconds": 0.022, "nccl_lines": lines}
    checks = collective.verdicts({"10.0.0.1": result}, {}, declared_gbps=100, fabric="ib")
    assert network_probe.bus_gbps(result) == pytest.approx(2 * 1 / 2 * (32 << 20) / 0.022 * 8 / 1e9, rel=1e-3)
    group, transports, *problems = checks
    assert not group["ok"] and "(declared 100 Gb/s)" in group["detail"]  # 12.2 Gb/s on a 100 Gb/s fabric
    assert transports["ok"] and "NET/Socket" in transports["detail"]
    assert problems and all(c["node"] == "10.0.0.1" and not c["ok"] for c in problems)
    assert any("fell back to sockets" in c["detail"] for c in problems), problems


def test_the_all_reduce_shrinks_to_what_the_slowest_link_moves_in_a_quarter_second():
    from alpa_job.cluster.doctor import collective

    assert collective.probe_bytes(None) == collective.probe_bytes(100.0) == 32 << 20
    assert collective.probe_bytes(0.02) == int(0.02e9 / 8 / 4)  # 20 Mbit/s: 625 kB
    assert collective.probe_bytes(0.001) == collective.MIN_BYTES


def test_the_route_to_a_host_is_read_without_sending_and_a_mismatch_is_named():
    here = links.route_to("127.0.0.1")
    assert here["source"] == "127.0.0.1" and here["iface"] == "lo" and here["error"] is None
    routes = {"10.0.0.2": {"source": "10.0.0.2", "iface": "eth0"}, "10.0.0.3": {"source": "192.168.5.3", "iface": "eth1", "error": None}}
    (c,) = network.route_checks(routes, {"10.0.0.2": "eth0", "10.0.0.3": "eth0"}, "10.0.0.1")
    assert c["node"] == "10.0.0.3" and not c["ok"]
    assert c["detail"] == ("Ray is bound to 10.0.0.3 (eth0) on 10.0.0.3, but the route to the head 10.0.0.1 leaves from 192.168.5.3 (eth1)")
    assert "--node-ip-address 192.168.5.3" in c["fix"]
