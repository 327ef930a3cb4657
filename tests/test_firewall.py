"""Firewall rendering: the text, the real `nft -c` parser, and real traffic in throw-away namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from alpa_job.cluster.firewall import render_nftables, render_sysctl
from alpa_job.cluster.spec import load_spec
from alpa_job.errors import KitError

REPO = Path(__file__).resolve().parents[1]
NFT = shutil.which("nft")
IS_ROOT = os.geteuid() == 0
needs_nft = pytest.mark.skipif(NFT is None or not IS_ROOT, reason="needs the nft binary (apt install nftables) and root for `nft -c`")


@pytest.fixture
def admin_spec(tmp_path):
    path = tmp_path / "admin.yaml"
    path.write_text("admin_cidrs: [192.168.0.0/16, '2001:db8::/32']\n")
    return load_spec(str(path))


def member_rule(port_text):
    return "ip saddr @members tcp dport %s add @accepted_tcp { tcp dport } accept" % port_text


def test_worker_rules_open_the_plan_to_members_only(spec):
    text = render_nftables(spec, "10.0.0.2", ["10.0.0.1", "10.0.0.3"], "worker")
    assert "elements = { 10.0.0.1, 10.0.0.2, 10.0.0.3 }" in text
    for span in spec.member_tcp_ports("worker"):
        assert member_rule(span.text()) + ' comment "%s"' % span.name in text
    for head_only in ("6379", "8265", "10001"):
        assert member_rule(head_only) not in text
    assert member_rule("20000-24999") in text and member_rule("40000-49999") in text
    assert "admin_v4" not in text and "admin_v6" not in text  # admin_cidrs is empty by default


def test_head_rules_add_the_head_only_ports(spec):
    text = render_nftables(spec, "10.0.0.1", ["10.0.0.2"], "head")
    for span in spec.member_tcp_ports("head"):
        assert member_rule(span.text()) in text
    assert member_rule("6379") in text and member_rule("8265") in text


def test_order_and_fail_fast_refusal(spec):
    lines = [l.strip() for l in render_nftables(spec, "10.0.0.2", [], "worker").splitlines()]
    # Idempotent load: create-then-delete our table only, then the new one.
    assert lines[3:5] == ["table inet alpa_kit {}", "delete table inet alpa_kit"]
    chain = lines[lines.index("chain input {") + 1 :]
    assert chain[:4] == [
        "type filter hook input priority filter; policy accept;",
        'iif "lo" accept',
        "ct state established,related accept",
        "meta l4proto { icmp, ipv6-icmp } accept",
    ]
    assert chain[-4].startswith("meta l4proto tcp add @rejected_tcp { tcp dport } counter reject with tcp reset")
    assert chain[-3].startswith("meta l4proto udp add @rejected_udp { udp dport } counter reject with icmpx")
    assert not any(" drop" in l for l in lines)


def test_admin_cidrs_reach_only_admin_ports(admin_spec):
    head = render_nftables(admin_spec, "10.0.0.1", [], "head")
    assert "elements = { 192.168.0.0/16 }" in head and "elements = { 2001:db8::/32 }" in head
    assert 'ip saddr @admin_v4 tcp dport { 22, 8265 } accept comment "admin: ssh, dashboard"' in head
    assert "ip6 saddr @admin_v6 tcp dport { 22, 8265 } accept" in head
    worker = render_nftables(admin_spec, "10.0.0.2", [], "worker")
    assert "ip saddr @admin_v4 tcp dport { 22 } accept" in worker  # nothing listens on 8265 there


@pytest.mark.parametrize(
    "args, expected",
    [
        (("10.0.0.2", ["192.168.1.9"], "worker"), "member IP 192.168.1.9 is not inside cluster_cidr 10.0.0.0/8"),
        (("192.168.1.2", [], "worker"), "node IP 192.168.1.2 is not inside cluster_cidr"),
        (("10.0.0.2", ["node-3"], "worker"), "member IP 'node-3' is not an IP address"),
        (("10.0.0.2", [], "driver"), "role must be 'head' or 'worker'"),
    ],
)
def test_refusals(spec, args, expected):
    with pytest.raises(KitError) as err:
        render_nftables(spec, *args)
    assert expected in str(err.value)
    with pytest.raises(KitError, match="nft table name"):
        render_nftables(spec, "10.0.0.2", [], "worker", table="alpa-kit; flush ruleset")


def test_sysctl_lines(spec):
    lines = render_sysctl(spec).splitlines()
    assert lines[-1] == "net.ipv4.ip_local_port_range = 40000 49999"
    assert all(l.startswith("#") for l in lines[:-1])


def test_cli_prints_the_ruleset(spec):
    done = subprocess.run(
        [sys.executable, "-m", "alpa_job.cluster.firewall", "--node-ip", "10.0.0.2", "--members", "10.0.0.1, 10.0.0.3", "--role", "worker"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == render_nftables(spec, "10.0.0.2", ["10.0.0.1", "10.0.0.3"], "worker")


@needs_nft
@pytest.mark.parametrize("role", ["head", "worker"])
@pytest.mark.parametrize("with_admin", [False, True])
def test_real_nft_accepts_the_ruleset(tmp_path, spec, admin_spec, role, with_admin):
    """`nft -c -f` parses and checks the script against the kernel without loading it."""
    text = render_nftables(admin_spec if with_admin else spec, "10.0.0.1", ["10.0.0.2", "10.0.0.3"], role)
    path = tmp_path / "rules.nft"
    path.write_text(text)
    done = subprocess.run([NFT, "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------------
# Real traffic: ns_member (10.99.0.1) connects to ns_node (10.99.0.2), which loads the rendered rules.

LISTEN = r"""
import select, socket, sys
socks = []
for port in map(int, sys.argv[2:]):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], port)); s.listen(16); socks.append(s)
print("ready", flush=True)
while True:
    for s in select.select(socks, [], [])[0]:
        s.accept()[0].close()
"""

PROBE = r"""
import json, socket, sys, time
out = {}
for port in map(int, sys.argv[2:]):
    start = time.monotonic()
    try:
        socket.create_connection((sys.argv[1], port), timeout=3).close(); result = "connected"
    except ConnectionRefusedError:
        result = "refused"
    except socket.timeout:
        result = "timeout"
    out[port] = [result, time.monotonic() - start]
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.sendto(b"x", (sys.argv[1], 9999))
print(json.dumps(out))
"""

MEMBER_IP, NODE_IP = "10.99.0.1", "10.99.0.2"  # the only addresses these tests create


def _netns_usable():
    return IS_ROOT and NFT is not None and shutil.which("ip") is not None


@pytest.fixture
def netns_pair():
    """Two namespaces joined by a veth pair; always deleted again (which also removes the veth)."""
    tag = uuid.uuid4().hex[:6]
    member, node = "akfwm%s" % tag, "akfwn%s" % tag
    created = []
    try:
        for ns in (member, node):
            subprocess.run(["ip", "netns", "add", ns], check=True)
            created.append(ns)
        veth = "akv%s" % tag
        subprocess.run(
            ["ip", "-n", member, "link", "add", veth + "a", "type", "veth", "peer", "name", veth + "b", "netns", node], check=True
        )
        for ns, dev, ip in ((member, veth + "a", MEMBER_IP), (node, veth + "b", NODE_IP)):
            subprocess.run(["ip", "-n", ns, "addr", "add", ip + "/24", "dev", dev], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        yield member, node
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], check=False)


def _in_ns(ns, *argv, **kwargs):
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=60, **kwargs)


def _load(ns, text, tmp_path):
    path = tmp_path / ("rules-%s.nft" % uuid.uuid4().hex[:6])
    path.write_text(text)
    done = _in_ns(ns, NFT, "-f", str(path))
    assert done.returncode == 0, done.stderr


def _set(ns, name):
    """{element: packets} of one of our counter sets."""
    done = _in_ns(ns, NFT, "-j", "list", "set", "inet", "alpa_kit", name)
    assert done.returncode == 0, done.stderr
    found = {}
    for item in json.loads(done.stdout)["nftables"]:
        for elem in item.get("set", {}).get("elem", []):
            value = elem["elem"]["val"]
            key = tuple(value["concat"]) if isinstance(value, dict) else value
            found[key] = elem["elem"]["counter"]["packets"]
    return found


def _probe(ns, *ports):
    done = _in_ns(ns, sys.executable, "-c", PROBE, NODE_IP, *map(str, ports))
    assert done.returncode == 0, done.stderr
    return {int(port): tuple(v) for port, v in json.loads(done.stdout).items()}


@pytest.mark.testbed
@pytest.mark.skipif(not _netns_usable(), reason="needs root, iproute2 and nftables for network namespaces")
def test_rules_in_a_namespace_refuse_fast_and_admit_members(tmp_path, netns_pair):
    member, node = netns_pair
    spec_file = tmp_path / "testbed.yaml"
    spec_file.write_text("cluster_cidr: 10.99.0.0/24\n")
    spec = load_spec(str(spec_file))
    planned, xla, head_only, unplanned = spec.ports["node_manager"], 20500, spec.ports["gcs"], 9999
    assert not any(s.covers(unplanned) for s in spec.member_tcp_ports())
    assert any(s.covers(xla) and s.name == "xla_grpc" for s in spec.member_tcp_ports())

    listener = subprocess.Popen(
        ["ip", "netns", "exec", node, sys.executable, "-c", LISTEN, NODE_IP, str(planned), str(xla), str(head_only), str(unplanned)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout.readline().strip() == "ready"
        # Without rules every listener answers: what follows is the firewall's doing.
        assert {p: r for p, (r, _) in _probe(member, planned, unplanned).items()} == {planned: "connected", unplanned: "connected"}

        _load(node, render_nftables(spec, NODE_IP, [MEMBER_IP, NODE_IP], "worker"), tmp_path)
        seen = _probe(member, planned, xla, head_only, unplanned)
        assert seen[planned][0] == "connected" and seen[xla][0] == "connected"
        for port in (unplanned, head_only):  # gcs is head-only: refused on a worker
            result, seconds = seen[port]
            assert result == "refused" and seconds < 1.0, seen
        assert {planned, xla} <= set(_set(node, "accepted_tcp"))
        assert {unplanned, head_only} <= set(_set(node, "rejected_tcp"))
        assert _set(node, "rejected_tcp_from")[(MEMBER_IP, unplanned)] >= 1
        assert _set(node, "rejected_udp").get(unplanned, 0) >= 1

        # Reloading replaces our table (idempotent): now 10.99.0.1 is not a member.
        _load(node, render_nftables(spec, NODE_IP, [NODE_IP], "worker"), tmp_path)
        assert _in_ns(node, NFT, "list", "tables").stdout.split("\n").count("table inet alpa_kit") == 1
        result, seconds = _probe(member, planned)[planned]
        assert result == "refused" and seconds < 1.0
        assert _set(node, "rejected_tcp_from") == {(MEMBER_IP, planned): 1}  # counters start afresh

        # The head's rules admit members to the head-only ports too.
        _load(node, render_nftables(spec, NODE_IP, [MEMBER_IP], "head"), tmp_path)
        assert _probe(member, head_only)[head_only][0] == "connected"
    finally:
        listener.kill()
        listener.wait(timeout=10)
