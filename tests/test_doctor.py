"""`python -m alpa_job doctor` against real clusters on the test bed, plus its pure checks.

Failure tests break one thing, run the doctor, and restore what they broke in `finally`.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alpa_job import versions
from alpa_job.cluster.doctor import checks as doctor
from alpa_job.cluster.doctor import matrix, render
from alpa_job.cluster.ray_api import gcs_address
from alpa_job.errors import EXIT_CHECK_FAILED
from fixtures_multihost import run_doctor

REPO = Path(__file__).resolve().parent.parent
PY39 = "/root/.pyenv/versions/3.9.18/bin/python"


# ---- pure checks, no cluster ---------------------------------------------------------------------
def test_node_ip_checks_name_the_fix():
    addrs = {"lo": ["127.0.0.1"], "eth0": ["10.77.0.2"], "mgmt0": ["192.168.77.2"]}
    (ok,) = doctor.check_node_ip("10.77.0.2", "10.77.0.2", addrs, "10.77.0.0/24")
    assert ok["ok"]
    (out,) = doctor.check_node_ip("192.168.77.2", "192.168.77.2", addrs, "10.77.0.0/24")
    assert not out["ok"] and "not in cluster CIDR 10.77.0.0/24" in out["detail"]
    assert "--node-ip-address=10.77.0.2" in out["fix"]
    (out,) = doctor.check_node_ip("10.77.0.9", "10.77.0.9", addrs, "10.77.0.0/24")
    assert not out["ok"] and "not an address of this host" in out["detail"] and "10.77.0.2" in out["detail"]


def test_port_plan_follows_the_spec_and_skips(spec):
    fixed, ranges = matrix.listen_plan(spec, skip=["ssh"])
    head_names = {n for n, _ in fixed["head"]}
    assert "gcs" in head_names and "gcs" not in {n for n, _ in fixed["worker"]}  # head-only ports: head only
    assert "ssh" not in head_names | {n for n, _ in fixed["worker"]}
    assert ("xla_grpc",) + spec.ranges["xla_grpc"] in ranges


def test_matrix_names_the_blocked_port_source_and_target(spec):
    """The all-pairs results of a cluster where w2 refuses the head on its node-manager port."""
    nm = spec.ports["node_manager"]
    head, w1, w2 = "10.77.0.1", "10.77.0.2", "10.77.0.3"
    listened = {
        ip: [
            {"name": "node_manager", "port": nm, "listener": "in use", "error": None},
            {"name": "xla_grpc", "port": spec.ranges["xla_grpc"][0], "listener": "ours", "error": None},
        ]
        for ip in (head, w1)
    }
    listened[w1].append({"name": "ssh", "port": 22, "listener": "none", "error": "EADDRNOTAVAIL"})
    plan, listen_checks = matrix.target_plan(
        [head, w1, w2], listened, {"head": [("gcs", 6379), ("node_manager", nm)], "worker": [("node_manager", nm), ("ssh", 22)]}, head
    )
    assert [p["port"] for p in plan[w2]] == [nm]  # w2 opened no listeners: probed on Ray's fixed ports only
    assert [c["node"] for c in listen_checks] == [w1] and "cannot listen on %s:22 (ssh)" % w1 in listen_checks[0]["detail"]
    assert matrix.connect_targets(head, plan) == [(w1, nm), (w1, spec.ranges["xla_grpc"][0]), (w2, nm)]
    ok = lambda ip, port: {"ip": ip, "port": port, "status": "ok"}  # noqa: E731
    connected = {
        head: [ok(w1, nm), ok(w1, spec.ranges["xla_grpc"][0]), {"ip": w2, "port": nm, "status": "refused"}],
        w1: [ok(head, nm), ok(w2, nm)],
    }  # w2 never reported
    grid, blocked = matrix.build_matrix([head, w1, w2], plan, connected)
    assert grid[head][w2] == {"ok": False, "probed": 1, "blocked": ["%d node_manager (refused)" % nm]}
    assert grid[head][w1]["ok"] and grid[w1][w2]["ok"] and grid[w2][head]["ok"] is None
    (bad,) = matrix.blocked_checks(spec, blocked)
    assert bad["node"] == w2 and bad["detail"] == "TCP %d (node_manager) blocked from %s (refused)" % (nm, head)
    assert bad["fix"].startswith("open TCP %d (node_manager) on %s" % (nm, w2))
    table = render.render_table(
        {"address": "a", "cluster_cidr": "c", "head": head, "seconds": 1, "ok": False, "matrix": grid, "checks": listen_checks + [bad]}
    )
    assert "blocked: %d node_manager (refused)" % nm in table and "FAIL ports     %s" % w2 in table
    summary = render.failure_summary({"ok": False, "checks": listen_checks + [bad]})
    assert summary.startswith("doctor: 2 check(s) failed; first: node %s: cannot listen" % w1)


def _collect_with(python: str) -> dict:
    code = "import json, sys; sys.path.insert(0, sys.argv[1]); from alpa_job import versions; print(json.dumps(versions.collect()))"
    return json.loads(subprocess.run([python, "-c", code, str(REPO)], capture_output=True, text=True, check=True, timeout=60).stdout)


@pytest.mark.skipif(not os.path.exists(PY39), reason="no Python 3.9 interpreter at " + PY39)
def test_version_skew_names_the_odd_node_with_real_interpreters():
    """Skew is detected from two REAL `versions.collect()` outputs: this venv's and Python 3.9's.

    Choice (documented): creating a real package skew inside the running test-bed cluster would
    need a second full environment per host (slow) or a fake dist-info (a fake). Every node runs
    `versions.collect()` in the doctor's probe and the comparison is `compare_versions`, a pure
    function; so it is fed what two real interpreters on this machine report (the Alpa image's
    Python 3.9 has no jax/ray installed here: that is a real skew too). The end-to-end path (probe ->
    compare) is exercised green on the 3-host cluster in test_doctor_green_on_three_hosts.
    """
    here, old = versions.collect(), _collect_with(PY39)
    assert old["python"].startswith("3.9.") and here["python"] != old["python"]
    per_node = {"10.77.0.1": here, "10.77.0.2": here, "10.77.0.3": old}
    checks = doctor.compare_versions(per_node, prefer="10.77.0.1")
    bad = [c for c in checks if not c["ok"]]
    assert bad and {c["node"] for c in bad} == {"10.77.0.3"}
    py = [c for c in bad if c["detail"].startswith("python ")][0]
    assert old["python"] in py["detail"] and here["python"] in py["detail"] and "10.77.0.1" in py["detail"]
    # two nodes, a tie: the head's value is the reference, the other node is named
    two = doctor.compare_versions({"10.77.0.1": here, "10.77.0.2": old}, prefer="10.77.0.1")
    assert {c["node"] for c in two if not c["ok"]} == {"10.77.0.2"}
    assert all(c["ok"] for c in doctor.compare_versions({"a": here, "b": dict(here)}))


@pytest.mark.skipif(not os.path.exists(PY39), reason="no Python 3.9 interpreter at " + PY39)
def test_doctor_imports_on_python39():
    p = subprocess.run(
        [PY39, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import alpa_job.cluster.doctor", str(REPO)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr


def test_unreachable_head_fails_fast_with_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = "127.0.0.1:%d" % port
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "alpa_job", "doctor", "--address", address], capture_output=True, text=True, timeout=60, cwd=str(REPO)
    )
    assert time.monotonic() - t0 < 30
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert address in lines[0] and "start the head" in lines[0]


# ---- on the 3-host firewalled cluster ------------------------------------------------------------


@pytest.mark.testbed
@pytest.mark.slow
def test_doctor_green_on_three_hosts(ray_cluster):
    bed = ray_cluster.testbed
    rc, data, p, seconds = run_doctor(bed, "head", ray_cluster.address, ray_cluster.spec_path, "--network")
    assert rc == 0 and data is not None and data["ok"] is True, (p.stdout[-4000:], p.stderr[-2000:])
    assert sorted(data["nodes"]) == sorted(bed.ips.values())
    # --network: every link measured both ways, even enough for no verdict
    links = data["network"]["links"]
    assert len(links) == 6 and all(r["gbps"] and r["rtt_ms"] for r in links), links
    # ... and one JAX process a node, joined as a job's are, timed an all-reduce over their CPU devices
    reduced = data["network"]["all_reduce"]
    assert reduced["devices"] >= 3 and reduced["backend"] == "cpu" and reduced["bus_gbps"] > 0, reduced
    assert [c for c in data["checks"] if c["name"] == "collective"][0]["ok"]
    for h in bed.hosts:
        node = data["nodes"][h.ip]
        assert node["hostname"] == h.name and h.ip in node["addresses"]["eth0"]
        assert node["shm_bytes"] >= 1 << 30
    ips = sorted(bed.ips.values())
    for src in ips:
        for dst in ips:
            if src != dst:
                cell = data["matrix"][src][dst]
                assert cell["ok"] is True and cell["probed"] >= 10, (src, dst, cell)
    # every planned port and a sample of every range was probed on each node
    for ip, ports in data["probed_ports"].items():
        names = {p.split()[1] for p in ports}
        assert {"node_manager", "object_manager", "xla_grpc", "ephemeral", "ray_workers"} <= names, ip
        assert ("gcs" in names) == (ip == ray_cluster.head_ip)
    table = bed.exec(
        "head",
        "python",
        "-m",
        "alpa_job",
        "doctor",
        "--address",
        ray_cluster.address,
        "--cluster-spec",
        str(ray_cluster.spec_path),
        timeout=90,
    )
    assert "TCP reachability" in table.stdout and "FAIL" not in table.stdout


@pytest.mark.testbed
@pytest.mark.slow
def test_doctor_network_names_a_rate_limited_host(ray_cluster):
    """A token bucket on w2's link (20 Mbit/s out of it, far below what the bed's links carry even when the
    machine is busy): --network names w2 as the slow host, its links at the limit within 30 %, and no other
    host or link."""
    bed = ray_cluster.testbed
    w2 = bed.host("w2").ip
    bed.exec("w2", "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "20mbit", "burst", "32kb", "latency", "50ms")
    try:
        rc, data, p, seconds = run_doctor(bed, "head", ray_cluster.address, ray_cluster.spec_path, "--network")
    finally:
        bed.exec("w2", "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
    links = (data or {}).get("network", {}).get("links")
    assert rc == EXIT_CHECK_FAILED and data is not None, (links, p.stderr[-2000:])
    failed = [c for c in data["checks"] if not c["ok"]]
    named = [c for c in failed if c["name"] == "network" and c["node"] == w2]
    assert len(named) == 1 and "every link from %s is slow" % w2 in named[0]["detail"], failed
    assert [c for c in failed if c["node"] not in (w2, None)] == [], failed
    out_of_w2 = [r["gbps"] for r in data["network"]["links"] if r["src"] == w2]
    assert len(out_of_w2) == 2 and all(0.014 <= g <= 0.026 for g in out_of_w2), data["network"]["links"]
    assert "every link from %s is slow" % w2 in p.stderr  # the one-line summary
    assert seconds < 60


def _nft_handles(bed, host, comment):
    out = bed.exec(host, "nft", "-a", "list", "chain", "inet", "alpa_kit", "input").stdout
    return [line.rsplit("handle", 1)[1].strip() for line in out.splitlines() if comment in line]


@pytest.mark.testbed
@pytest.mark.slow
def test_doctor_names_a_blocked_port(ray_cluster):
    """w2 refuses NEW connections from the head to its node-manager port and the XLA range."""
    bed = ray_cluster.testbed
    head, w2 = ray_cluster.head_ip, bed.host("w2").ip
    nm = ray_cluster.spec.ports["node_manager"]
    xla = "%d-%d" % ray_cluster.spec.ranges["xla_grpc"]
    comment = "akt-doctor-test-block"
    t0 = time.monotonic()
    # `ct state new`: Ray's established raylet channels survive, so the cluster stays healthy after.
    bed.exec(
        "w2",
        "nft",
        "insert",
        "rule",
        "inet",
        "alpa_kit",
        "input",
        "ip",
        "saddr",
        head,
        "tcp",
        "dport",
        "{ %d, %s }" % (nm, xla),
        "ct",
        "state",
        "new",
        "counter",
        "reject",
        "with",
        "tcp",
        "reset",
        "comment",
        '"%s"' % comment,
    )
    try:
        rc, data, p, seconds = run_doctor(bed, "head", ray_cluster.address, ray_cluster.spec_path)
    finally:
        for handle in _nft_handles(bed, "w2", comment):
            bed.exec("w2", "nft", "delete", "rule", "inet", "alpa_kit", "input", "handle", handle)
    assert not _nft_handles(bed, "w2", comment)
    assert rc == EXIT_CHECK_FAILED and data["ok"] is False, p.stdout[-3000:]
    failed = [c for c in data["checks"] if not c["ok"]]
    assert {c["node"] for c in failed} == {w2}, failed
    nm_check = [c for c in failed if "%d (node_manager)" % nm in c["detail"]]
    assert nm_check and head in nm_check[0]["detail"] and "open TCP %d" % nm in nm_check[0]["fix"]
    assert any("xla_grpc" in c["detail"] for c in failed)
    assert not data["matrix"][head][w2]["ok"] and data["matrix"][bed.host("w1").ip][w2]["ok"]
    assert "node %s" % w2 in p.stderr and str(nm) in p.stderr  # the one-line summary
    assert time.monotonic() - t0 < 30, "doctor failure test took %.1f s" % (time.monotonic() - t0)


@pytest.mark.testbed
@pytest.mark.slow
def test_doctor_unreachable_head_from_a_member(ray_cluster):
    """Inside the cluster network, a head address nobody answers on: non-zero in seconds, one line."""
    bed = ray_cluster.testbed
    t0 = time.monotonic()
    address = gcs_address(ray_cluster.spec, "10.77.0.99")
    p = bed.exec("w1", "python", "-m", "alpa_job", "doctor", "--address", address, timeout=60, check=False)
    assert time.monotonic() - t0 < 30
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and address in lines[0], p.stderr


@pytest.mark.testbed
@pytest.mark.slow
def test_doctor_names_a_node_ip_outside_the_cidr(mgmt_cluster):
    """w1 joins with --node-ip-address = its management-NIC IP (a real address of w1, outside the CIDR).

    Ray accepts it (the head reaches w1 over the management network), `ray status` is green; the
    doctor names the node and the address to restart it with.
    """
    bed = mgmt_cluster.testbed
    w1 = bed.host("w1")
    t0 = time.monotonic()
    try:
        mgmt_cluster.start_worker(node_ip=w1.mgmt_ip)
        assert w1.mgmt_ip in mgmt_cluster.alive(2)
        rc, data, p, seconds = run_doctor(bed, "head", mgmt_cluster.address, mgmt_cluster.spec_path)
    finally:
        mgmt_cluster.stop_worker()
    assert rc == EXIT_CHECK_FAILED and data["ok"] is False, p.stdout[-3000:]
    bad = [c for c in data["checks"] if not c["ok"] and c["name"] == "node_ip"]
    assert bad and bad[0]["node"] == w1.mgmt_ip
    assert "not in cluster CIDR %s" % bed.subnet in bad[0]["detail"]
    assert "--node-ip-address=%s" % w1.ip in bad[0]["fix"]
    assert seconds < 30 and time.monotonic() - t0 < 45
