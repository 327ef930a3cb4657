"""Jinja filters that call the kit's own renderers (alpa_job.cluster), so Ansible renders nothing itself.

The playbooks never spell a port, a flag or an nft rule: `ray start` argv, the nftables ruleset, the
sysctl lines, NCCL's fabric environment and the node IP all come from the same functions as the CLIs
(`python -m alpa_job.cluster.ray_start | firewall | node_ip`). The plan itself is read here too:
`alpa_kit_load_spec` loads alpa_job/cluster/cluster.yaml (plus the user's file, like `--cluster-spec`)
for the alpa_kit role's DEFAULTS, and `alpa_kit_spec_over` merges whatever alpa_kit_<key> the inventory
sets over it, so inventory vars win and the plan is never copied into a YAML file of the playbook.

The filters run on the controller (the machine with this checkout), in-process: nodes need no copy
of the kit for rendering (the docker runtime's nodes need only Docker), and `--check` renders too.
The node IP still comes from each node: its own interface addresses, from its gathered facts.
"""

from __future__ import annotations

import ipaddress
import os
import sys

from ansible.errors import AnsibleFilterError

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:  # `cd ansible && ansible-playbook site.yml` from a checkout: use its package
    sys.path.insert(0, _REPO)

_SOURCE = "ansible vars (alpa_kit_*)"
# load_spec() results by (path, mtime): every task templates alpa_kit_spec again (Ansible 2.19 is lazy).
_LOADED = {}


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


def load_spec(path=""):
    """cluster.yaml's plan as plain data: the package's file, with the user's `path` merged over it
    (empty: $ALPA_KIT_CLUSTER_SPEC on the controller, else the package's file alone), like the CLIs."""
    spec, _, _, _, KitError = _kit()
    path = str(path or "") or os.environ.get(spec.SPEC_ENV_VAR, "")
    try:
        key = (path, os.path.getmtime(path) if path else None)
    except OSError:
        key = (path, None)
    if key not in _LOADED:
        try:
            _LOADED[key] = spec.load_spec(path or None).as_dict()
        except KitError as err:
            raise AnsibleFilterError("cluster spec: %s" % err) from None
    return _LOADED[key]


def spec_over(given, base):
    """`base` (cluster.yaml's plan) with the alpa_kit_<key> values in `given` merged over it: nested
    mappings merge key by key (alpa_kit_ports: {dashboard: 8266} moves that port only), lists and
    scalars replace; validated by the kit (unknown keys, overlaps, CIDRs). Plain data."""
    spec, _, _, _, KitError = _kit()
    try:
        merged = spec._deep_merge(_plain(base), _plain(given or {}), _SOURCE, where="")
        return spec.spec_from_dict(merged, source=_SOURCE).as_dict()
    except KitError as err:
        raise AnsibleFilterError("cluster spec: %s" % err) from None


def image_ref(name, registry=""):
    """The image reference the nodes run: `registry/name` (registry = host[:port][/path]) or `name`."""
    name, registry = str(name).strip(), str(registry or "").strip().rstrip("/")
    return "%s/%s" % (registry, name) if registry else name


def image_parts(ref):
    """{registry, repository, tag, api_host, manifest_path} of an image reference, the way Docker splits it:
    the first path part is a registry when it has a dot or a colon or is `localhost` (else Docker Hub).
    """
    ref = str(ref).strip()
    name, _, digest = ref.partition("@")
    first, slash, rest = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = "", name
    repo, colon, tag = path.rpartition(":")
    if not colon or "/" in tag:
        repo, tag = path, "latest"
    reference = digest or tag
    api_repo = repo if registry or "/" in repo else "library/" + repo  # Docker Hub's official images
    return {
        "registry": registry,
        "repository": repo,
        "tag": tag,
        "api_host": registry or "registry-1.docker.io",
        "manifest_path": "/v2/%s/manifests/%s" % (api_repo, reference),
    }


def controller_admission(controller, raw_spec, members, local_ips=(), auto=True, host=""):
    """Whether the node's firewall admits the controller (the address the node sees its SSH from).

    Returns {"admit": [CIDRs to add to the node's admin set], "error": "" or the one-line fix}. The
    controller passes when it is local (no SSH or loopback or one of the node's own addresses), a
    member, or inside admin_cidrs; otherwise, with admin_cidrs empty and `auto`, its own address is
    admitted to the admin ports; with admin_cidrs set (or auto off) that is a lock-out: an error.
    """
    cidrs = list(_spec(raw_spec).admin_cidrs)
    who = "host %s: " % host if host else ""
    text = str(controller or "").strip()
    if not text:
        return {"admit": [], "error": ""}  # ansible_connection=local (or the node is the controller)
    try:
        address = ipaddress.ip_address(text)
    except ValueError:  # no SSH_CLIENT: admin_cidrs set by the operator are trusted, none is a lock-out
        return {
            "admit": [],
            "error": ""
            if cidrs
            else (
                "%scannot tell the controller's address (SSH_CLIENT: %r), so the firewall could lock you out; set "
                "alpa_kit_admin_cidrs to the network you run ansible-playbook from" % (who, text)
            ),
        }
    if address.is_loopback or text in [str(i) for i in local_ips] or text in [str(m) for m in members]:
        return {"admit": [], "error": ""}
    if any(address in ipaddress.ip_network(c) for c in cidrs if ipaddress.ip_network(c).version == address.version):
        return {"admit": [], "error": ""}
    if cidrs or not auto:
        return {
            "admit": [],
            "error": (
                "%sthe controller reaches this node from %s, which neither alpa_kit_admin_cidrs (%s) nor the cluster's "
                "members hold: its firewall would lock you out. Add %s/%d to alpa_kit_admin_cidrs (or run from an "
                "admitted address)" % (who, text, ", ".join(cidrs) or "empty", text, address.max_prefixlen)
            ),
        }
    return {"admit": ["%s/%d" % (text, address.max_prefixlen)], "error": ""}


def with_admin(raw_spec, extra):
    """The plan with `extra` CIDRs appended to admin_cidrs (the controller this run found)."""
    plan = dict(_plain(raw_spec))
    plan["admin_cidrs"] = list(plan.get("admin_cidrs") or []) + [c for c in _plain(extra or []) if c not in (plan.get("admin_cidrs") or [])]
    return spec_check(plan)


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


def ray_start_args(
    raw_spec,
    role,
    node_ip_,
    head_ip=None,
    ray_version=None,
    num_cpus=None,
    num_gpus=None,
    object_store_memory=None,
    include_dashboard=True,
    block=False,
):
    """The `ray start` argv for one node (alpa_job.cluster.ray_start.ray_start_args)."""
    _, ray_start, _, _, KitError = _kit()

    def opt_int(v):
        return None if v in (None, "") else int(v)

    try:
        return ray_start.ray_start_args(
            _spec(raw_spec),
            str(role),
            str(node_ip_),
            head_ip=None if head_ip in (None, "") else str(head_ip),
            ray_version=None if ray_version in (None, "") else str(ray_version),
            num_cpus=opt_int(num_cpus),
            num_gpus=opt_int(num_gpus),
            object_store_memory=opt_int(object_store_memory),
            include_dashboard=bool(include_dashboard),
            block=bool(block),
        )
    except KitError as err:
        raise AnsibleFilterError("ray start arguments: %s" % err) from None


def nftables(raw_spec, node_ip_, members, role, table="alpa_kit"):
    """The nft script for this node (alpa_job.cluster.firewall.render_nftables)."""
    _, _, firewall, _, KitError = _kit()
    try:
        return firewall.render_nftables(_spec(raw_spec), str(node_ip_), [str(m) for m in members], str(role), table=str(table))
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


def nccl_env(raw_spec):
    """NCCL's environment for the declared fabric (ClusterSpec.nccl_env): sockets for ethernet, IB for ib/roce,
    and the socket transport's threads and sockets on every fabric."""
    return dict(_spec(raw_spec).nccl_env())


def rdma(raw_spec):
    """Whether the declared fabric is RDMA (ib, roce): the container then needs the RDMA devices."""
    return _spec(raw_spec).network.rdma


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
            "alpa_kit_load_spec": load_spec,
            "alpa_kit_spec_over": spec_over,
            "alpa_kit_spec_check": spec_check,
            "alpa_kit_with_admin": with_admin,
            "alpa_kit_controller_admission": controller_admission,
            "alpa_kit_image_ref": image_ref,
            "alpa_kit_image_parts": image_parts,
            "alpa_kit_node_ip": node_ip,
            "alpa_kit_node_iface": node_iface,
            "alpa_kit_ray_start_args": ray_start_args,
            "alpa_kit_nftables": nftables,
            "alpa_kit_sysctl_text": sysctl_text,
            "alpa_kit_sysctl": sysctl_map,
            "alpa_kit_xla_env": xla_env,
            "alpa_kit_nccl_env": nccl_env,
            "alpa_kit_rdma": rdma,
            "alpa_kit_ray_version_at_least": ray_version_at_least,
        }
