"""alpa_job.cluster.netpol: the NetworkPolicy's member ports as an nftables ruleset (no test bed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from alpa_job.cluster import netpol
from alpa_job.cluster.spec import load_spec
from alpa_job.errors import KitError

REPO = Path(__file__).resolve().parents[1]
MEMBERS = {"ray.io/cluster": "alpa"}


def policy(*ingress, selector=MEMBERS):
    return {
        "kind": "NetworkPolicy",
        "metadata": {"name": "p"},
        "spec": {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": ["Ingress"], "ingress": list(ingress)},
    }


def rule(peers, *ports):
    return {"from": peers, "ports": [dict(protocol="TCP", **p) for p in ports]}


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("cluster_cidr: 10.77.0.0/24\n")
    return load_spec(str(path))


def test_repo_policy_member_ports_cover_the_plan_except_ssh():
    spans = netpol.member_port_spans(netpol.load_policy(REPO / "k8s" / "networkpolicy.yaml"))
    got = {(s.lo, s.hi) for s in spans}
    plan = load_spec(None)
    want = {(s.lo, s.hi) for s in plan.member_tcp_ports() if s.name != "ssh"}
    assert got == want
    assert all(not s.covers(plan.ports["ssh"]) for s in spans)


def test_only_rules_from_the_clusters_own_pods_count():
    p = policy(
        rule([{"podSelector": {"matchLabels": MEMBERS}}], {"port": 8076}, {"port": 20000, "endPort": 24999}),
        rule([{"namespaceSelector": {"matchLabels": {"admin": "true"}}}], {"port": 8265}),
        rule([{"podSelector": {"matchLabels": {"ray.io/originated-from-crd": "RayJob"}}}], {"port": 8266}),
        rule([{"podSelector": {}}], {"port": 9999}),  # every pod of the namespace: not members-only
        rule([{"ipBlock": {"cidr": "10.0.0.0/8"}}], {"port": 9998}),
    )
    assert [(s.lo, s.hi) for s in netpol.member_port_spans(p)] == [(8076, 8076), (20000, 24999)]


def test_refuses_what_it_cannot_model():
    members = [{"podSelector": {"matchLabels": MEMBERS}}]
    with pytest.raises(KitError, match="named ports"):
        netpol.member_port_spans(policy(rule(members, {"port": "gcs"})))
    with pytest.raises(KitError, match="UDP"):
        netpol.member_port_spans(policy({"from": members, "ports": [{"protocol": "UDP", "port": 53}]}))
    with pytest.raises(KitError, match="no ports"):
        netpol.member_port_spans(policy({"from": members}))
    with pytest.raises(KitError, match="no ingress rule"):
        netpol.member_port_spans(policy(rule([{"podSelector": {}}], {"port": 1})))


def test_rendered_ruleset_accepts_exactly_the_policy_ports_from_members(spec):
    p = policy(rule([{"podSelector": {"matchLabels": MEMBERS}}], {"port": 6379}, {"port": 10002, "endPort": 19999}))
    text = netpol.render_policy_nftables(p, spec, "10.77.0.1", ["10.77.0.2", "10.77.0.3"])
    accepts = [line.strip() for line in text.splitlines() if "@members tcp dport" in line]
    assert [a.split("tcp dport ")[1].split()[0] for a in accepts] == ["6379", "10002-19999"]
    assert "elements = { 10.77.0.1, 10.77.0.2, 10.77.0.3 }" in text
    assert "reject with tcp reset" in text and "NetworkPolicy p" in text
    assert "dport 22 " not in text
    with pytest.raises(KitError, match="cluster_cidr"):
        netpol.render_policy_nftables(p, spec, "10.77.0.1", ["192.168.0.2"])


def test_doctor_skip_ports_refuses_unknown_names(spec):
    from alpa_job.cluster.doctor.run import run_doctor

    with pytest.raises(KitError, match="--skip-ports names sshd"):
        run_doctor("127.0.0.1:1", spec, skip_ports=["sshd"])
