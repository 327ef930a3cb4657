"""The ports a Kubernetes NetworkPolicy opens between a RayCluster's own pods, as a host firewall.

k8s/networkpolicy.yaml is the port plan on Kubernetes. To run KubeRay's command lines on hosts without
Kubernetes (the test bed) under the same rules, this reads the policy's ingress rules that admit the
cluster's own pods (a `from` podSelector whose labels the policy's own podSelector also requires, with
no namespaceSelector: same namespace, same cluster) and renders their ports (`port`, or `port`..`endPort`)
with alpa_job.cluster.firewall: those TCP ports are accepted from the member IPs, everything else gets a
TCP reset. The same rules hold on every pod (the policy does not tell head from workers).

Rules for other peers (admin namespaces, RayJob submitter pods, ipBlocks) have no host equivalent here
and are left out: they only ever admit non-members. Named ports and non-TCP protocols are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, List, Mapping, Union

import yaml

from alpa_job.cluster.firewall import render_nftables
from alpa_job.cluster.spec import ClusterSpec, PortSpan
from alpa_job.errors import KitError


def load_policy(path: Union[str, Path]) -> Mapping[str, Any]:
    """The (single) NetworkPolicy of a YAML file (other documents in it are ignored)."""
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d and d.get("kind") == "NetworkPolicy"]
    if len(docs) != 1:
        raise KitError("%s: expected exactly one NetworkPolicy, found %d" % (path, len(docs)))
    return docs[0]


def _selects_members(peer: Mapping[str, Any], members: Mapping[str, str]) -> bool:
    """A `from` peer that admits only pods of the cluster (same namespace, the policy's own labels)."""
    if "namespaceSelector" in peer or "ipBlock" in peer or "podSelector" not in peer:
        return False
    selector = peer["podSelector"] or {}
    if selector.get("matchExpressions"):
        raise KitError("podSelector.matchExpressions is not modelled; use matchLabels")
    labels = selector.get("matchLabels") or {}
    # The peer must require every label that makes a pod a member; an empty selector (all pods) does not.
    return bool(members) and all(labels.get(k) == v for k, v in members.items())


def member_port_spans(policy: Mapping[str, Any]) -> List[PortSpan]:
    """The TCP ports and ranges the policy opens from the cluster's pods to the cluster's pods, lowest first."""
    spec = policy.get("spec") or {}
    if "Ingress" not in (spec.get("policyTypes") or ["Ingress"]):
        raise KitError("the NetworkPolicy has no Ingress policy type: nothing to render")
    pod_selector = spec.get("podSelector") or {}
    if pod_selector.get("matchExpressions"):
        raise KitError("the policy's podSelector.matchExpressions is not modelled; use matchLabels")
    members = pod_selector.get("matchLabels") or {}
    name = (policy.get("metadata") or {}).get("name", "networkpolicy")
    spans = set()
    for rule in spec.get("ingress") or []:
        if not any(_selects_members(peer, members) for peer in rule.get("from") or []):
            continue
        if not rule.get("ports"):
            # A rule without ports admits every port: the firewall would be moot; refuse rather than guess.
            raise KitError("%s: an ingress rule from the cluster's pods lists no ports (all ports open)" % name)
        for item in rule["ports"]:
            protocol = item.get("protocol", "TCP")
            port = item.get("port")
            if protocol != "TCP":
                raise KitError("%s: protocol %s is not modelled (TCP only)" % (name, protocol))
            if not isinstance(port, int) or isinstance(port, bool):
                raise KitError("%s: port %r must be a number (named ports are not modelled)" % (name, port))
            end = item.get("endPort", port)
            if not isinstance(end, int) or not 0 < port <= end <= 65535:
                raise KitError("%s: bad port range %r-%r" % (name, port, end))
            spans.add((port, end))
    if not spans:
        raise KitError("%s: no ingress rule admits the cluster's own pods %s" % (name, members))
    return [PortSpan("%s %s" % (name, lo if lo == hi else "%d-%d" % (lo, hi)), lo, hi) for lo, hi in sorted(spans)]


def render_policy_nftables(
    policy: Mapping[str, Any], spec: ClusterSpec, node_ip: str, member_ips: Iterable[str], table: str = "alpa_kit"
) -> str:
    """The nft script for one node: the policy's member ports from `member_ips`, a TCP reset for the rest.

    `spec` supplies the cluster CIDR the IPs are checked against (and admin_cidrs, normally empty here).
    """
    name = (policy.get("metadata") or {}).get("name", "networkpolicy")
    return render_nftables(
        spec, node_ip, member_ips, "worker", table=table, member_ports=member_port_spans(policy), source="NetworkPolicy %s" % name
    )
