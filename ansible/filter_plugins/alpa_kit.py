"""Jinja filters that call the kit's own renderers (alpa_job.cluster), so Ansible renders nothing itself.

The playbooks never spell a port, a flag or an nft rule: `ray start` argv, the nftables ruleset, the
sysctl lines and the node IP all come from the same functions as the CLIs
(`python -m alpa_job.cluster.ray_start | firewall | node_ip`), fed with the cluster spec that
group_vars/all.yml builds (`alpa_kit_spec`, held equal to alpa_job/cluster/cluster.yaml by a test).

The filters run on the controller (the machine with this checkout), in-process: nodes need no copy
of the kit for rendering (the docker runtime's nodes need only Docker), and `--check` renders too.
The node IP still comes from each node: its own interface addresses, from its gathered facts.
"""
from __future__ import annotations

import os
import sys

from ansible.errors import AnsibleFilterError

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:  # `cd ansible && ansible-playbook site.yml` from a checkout: use its package
    sys.path.insert(0, _REPO)

_SOURCE = "ansible group_vars (alpa_kit_*)"


def _kit():
    try:
        from alpa_job.cluster import firewall, node_ip, ray_start, spec
        from alpa_job.errors import KitError
    except ImportError as err:  # pragma: no cover - a broken checkout
        raise AnsibleFilterError(
            "the alpa_kit filters need the alpa_job package (this checkout: %s) and PyYAML on the "
            "controller's Python (%s): %s" % (_REPO, sys.executable, err)
        ) from None
    return spec, ray_start, firewall, node_ip, KitError


def _plain(value):
    """Ansible 2.19 hands tagged str/int/dict subclasses: make them plain for the kit's type checks."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    return value


def _spec(raw):
    spec, _, _, _, KitError = _kit()
    try:
        return spec.spec_from_dict(_plain(raw), source=_SOURCE)
    except KitError as err:
        raise AnsibleFilterError("cluster spec: %s" % err) from None


def spec_check(raw):
    """The validated spec as plain data (cluster.yaml's layout); fails with the kit's message."""
    return _spec(raw).as_dict()


def _addresses(facts):
    """{interface: [IPv4 addresses]} from a host's gathered facts (primary and secondary addresses)."""
    facts = _plain(facts or {})
    found = {}
    for iface in facts.get("interfaces") or []:
        info = facts.get(iface.replace("-", "_").replace(".", "_").replace(":", "_")) or {}
        ips = []
        primary = info.get("ipv4") or {}
        if isinstance(primary, dict) and primary.get("address"):
            ips.append(primary["address"])
        for extra in info.get("ipv4_secondaries") or []:
            if extra.get("address"):
                ips.append(extra["address"])
        if ips:
            found[iface] = ips
    return found


def node_ip(facts, raw_spec, host=""):
    """This node's Ray IP: the address of its ONE interface inside cluster_cidr (the kit's select_node_ip)."""
    _, _, _, node_ip_mod, KitError = _kit()
    cidr = _spec(raw_spec).cluster_cidr
    try:
        return node_ip_mod.select_node_ip(cidr, _addresses(facts))
    except KitError as err:
        raise AnsibleFilterError("%s%s" % ("host %s: " % host if host else "", err)) from None


def node_iface(facts, ip):
    """The interface that holds `ip` (NCCL_SOCKET_IFNAME)."""
    for iface, ips in _addresses(facts).items():
        if str(ip) in ips:
            return iface
    raise AnsibleFilterError("no interface holds %s (interfaces: %s)" % (ip, _addresses(facts)))


def ray_start_args(raw_spec, role, node_ip_, head_ip=None, ray_version=None, num_cpus=None, num_gpus=None,
                   object_store_memory=None, include_dashboard=True, block=False):
    """The `ray start` argv for one node (alpa_job.cluster.ray_start.ray_start_args)."""
    _, ray_start, _, _, KitError = _kit()

    def opt_int(v):
        return None if v in (None, "") else int(v)

    try:
        return ray_start.ray_start_args(
            _spec(raw_spec), str(role), str(node_ip_), head_ip=None if head_ip in (None, "") else str(head_ip),
            ray_version=None if ray_version in (None, "") else str(ray_version), num_cpus=opt_int(num_cpus),
            num_gpus=opt_int(num_gpus), object_store_memory=opt_int(object_store_memory),
            include_dashboard=bool(include_dashboard), block=bool(block),
        )
    except KitError as err:
        raise AnsibleFilterError("ray start arguments: %s" % err) from None


def nftables(raw_spec, node_ip_, members, role, table="alpa_kit"):
    """The nft script for this node (alpa_job.cluster.firewall.render_nftables)."""
    _, _, firewall, _, KitError = _kit()
    try:
        return firewall.render_nftables(_spec(raw_spec), str(node_ip_), [str(m) for m in members], str(role),
                                        table=str(table))
    except KitError as err:
        raise AnsibleFilterError("firewall: %s" % err) from None


def sysctl_text(raw_spec):
    """/etc/sysctl.d/ lines (alpa_job.cluster.firewall.render_sysctl)."""
    _, _, firewall, _, _ = _kit()
    return firewall.render_sysctl(_spec(raw_spec))


def sysctl_map(raw_spec):
    """{key: value} of the kernel settings every node needs."""
    return dict(_spec(raw_spec).sysctl())


def xla_env(raw_spec):
    """XLA_SERVER_PORT_START/END (END exclusive) for Alpa's XLA gRPC servers."""
    return dict(_spec(raw_spec).xla_env())


def ray_version_at_least(version, minimum):
    """True when Ray `version` >= `minimum` (both MAJOR.MINOR[.PATCH])."""
    _, ray_start, _, _, KitError = _kit()
    try:
        return ray_start.parse_ray_version(str(version)) >= ray_start.parse_ray_version(str(minimum))
    except KitError as err:
        raise AnsibleFilterError(str(err)) from None


class FilterModule:
    """alpa_kit_* filters."""

    def filters(self):
        return {
            "alpa_kit_spec_check": spec_check,
            "alpa_kit_node_ip": node_ip,
            "alpa_kit_node_iface": node_iface,
            "alpa_kit_ray_start_args": ray_start_args,
            "alpa_kit_nftables": nftables,
            "alpa_kit_sysctl_text": sysctl_text,
            "alpa_kit_sysctl": sysctl_map,
            "alpa_kit_xla_env": xla_env,
            "alpa_kit_ray_version_at_least": ray_version_at_least,
        }
