"""The cluster's shape, loaded once from cluster.yaml (plus a user's overrides) and validated.

Everything that renders an artefact (`ray start` arguments, firewall rules, sysctl lines, NCCL's fabric
environment, the doctor's checks) reads a `ClusterSpec` from `load_spec()`, never the YAML itself, so a port is written once.

Override order: the package's cluster.yaml, then the user's file (the `path` argument, else the
ALPA_KIT_CLUSTER_SPEC environment variable), deep-merged: only the keys the user sets change, and a
key the defaults do not have is refused (a typo must not silently leave a default in place).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import yaml

from alpa_job.cluster.fabric import NetworkSpec, network_from_dict
from alpa_job.errors import KitError

DEFAULT_SPEC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster.yaml")
SPEC_ENV_VAR = "ALPA_KIT_CLUSTER_SPEC"

# Names the renderers use by name; the package defaults must define them (a user cannot remove keys).
REQUIRED_PORTS = (
    "ssh",
    "gcs",
    "dashboard",
    "client",
    "node_manager",
    "object_manager",
    "dashboard_agent_grpc",
    "runtime_env_agent",
    "metrics_export",
    "dashboard_agent_listen",
)
REQUIRED_RANGES = ("ray_workers", "xla_grpc", "ephemeral")
REQUIRED_VERSIONS = ("ray_legacy", "ray_modern")


class PortSpan(NamedTuple):
    """One planned TCP port (lo == hi) or inclusive range, and whether only the head listens on it."""

    name: str
    lo: int
    hi: int
    head_only: bool = False

    def covers(self, port: int) -> bool:
        return self.lo <= port <= self.hi

    def overlaps(self, other: "PortSpan") -> bool:
        return self.lo <= other.hi and other.lo <= self.hi

    @property
    def is_range(self) -> bool:
        return self.lo != self.hi

    def text(self) -> str:
        """`8076` or `20000-24999`: the form both humans and nft read."""
        return str(self.lo) if not self.is_range else "%d-%d" % (self.lo, self.hi)


@dataclass(frozen=True)
class ClusterSpec:
    """The validated, read-only cluster shape. Build it with `load_spec()`."""

    cluster_cidr: str
    admin_cidrs: Tuple[str, ...]
    admin_ports: Tuple[str, ...]
    ports: Mapping[str, int]
    ranges: Mapping[str, Tuple[int, int]]
    head_only_ports: Tuple[str, ...]
    jax_coordinator_port: int
    versions: Mapping[str, str]
    images: Mapping[str, str]
    network: NetworkSpec
    # Where the values came from, for error messages; not part of the shape.
    source: str = field(default="package defaults", compare=False)

    @property
    def cluster_network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.cluster_cidr)

    def cluster_ipv4(self, ip: str, what: str, not_an_ip_fix: str, outside_fix: str) -> str:
        """`ip` normalised, or a KitError naming `what` and the fix: an IPv4 address in the CIDR."""
        try:
            address = ipaddress.ip_address(str(ip).strip())
        except ValueError:
            raise KitError("%s %r is not an IP address; %s" % (what, ip, not_an_ip_fix)) from None
        if address.version != 4 or address not in self.cluster_network:
            raise KitError("%s %s is not inside cluster_cidr %s; %s" % (what, address, self.cluster_cidr, outside_fix))
        return str(address)

    def span(self, name: str) -> PortSpan:
        """The planned port or range called `name`."""
        if name in self.ports:
            port = self.ports[name]
            return PortSpan(name, port, port, name in self.head_only_ports)
        if name in self.ranges:
            lo, hi = self.ranges[name]
            return PortSpan(name, lo, hi, False)
        raise KitError("no port or range named %r in the cluster spec; known: %s" % (name, ", ".join(list(self.ports) + list(self.ranges))))

    def member_tcp_ports(self, role: Optional[str] = None) -> List[PortSpan]:
        """Every TCP port and range cluster members must reach on a node, lowest first.

        `role=None` lists all of them (head-only ones flagged); "worker" leaves the head-only ones out,
        "head" keeps them.
        """
        if role not in (None, "head", "worker"):
            raise KitError("role must be 'head' or 'worker', not %r" % (role,))
        spans = [self.span(name) for name in list(self.ports) + list(self.ranges)]
        if role == "worker":
            spans = [s for s in spans if not s.head_only]
        return sorted(spans, key=lambda s: (s.lo, s.hi))

    def admin_tcp_ports(self, role: Optional[str] = None) -> List[PortSpan]:
        """The ports `admin_cidrs` may reach (head-only ones only on the head when a role is given)."""
        spans = [self.span(name) for name in self.admin_ports]
        if role == "worker":
            spans = [s for s in spans if not s.head_only]
        return sorted(spans, key=lambda s: (s.lo, s.hi))

    def xla_env(self) -> Dict[str, str]:
        """Alpa's XLA gRPC port range as the env vars Alpa reads.

        Alpa picks a port in [XLA_SERVER_PORT_START, XLA_SERVER_PORT_END): END is exclusive, while the
        spec's ranges are inclusive (they are also what the firewall opens), so END is hi + 1.
        """
        lo, hi = self.ranges["xla_grpc"]
        return {"XLA_SERVER_PORT_START": str(lo), "XLA_SERVER_PORT_END": str(hi + 1)}

    def sysctl(self) -> Dict[str, str]:
        """Kernel settings every node needs: NCCL/gloo bind ephemeral ports, so pin that range.

        The kernel's ip_local_port_range is inclusive at both ends, like the spec's ranges.
        """
        lo, hi = self.ranges["ephemeral"]
        return {"net.ipv4.ip_local_port_range": "%d %d" % (lo, hi)}

    def nccl_env(self) -> Dict[str, str]:
        """NCCL's environment for the declared fabric (network.fabric): what every runtime sets."""
        return self.network.nccl_env()

    def as_dict(self) -> Dict[str, Any]:
        """Plain data in cluster.yaml's layout (lists, dicts, str, int): JSON- and YAML-ready."""
        return {
            "cluster_cidr": self.cluster_cidr,
            "admin_cidrs": list(self.admin_cidrs),
            "admin_ports": list(self.admin_ports),
            "ports": dict(self.ports),
            "ranges": {name: [lo, hi] for name, (lo, hi) in self.ranges.items()},
            "head_only_ports": list(self.head_only_ports),
            "jax_coordinator_port": self.jax_coordinator_port,
            "versions": dict(self.versions),
            "images": dict(self.images),
            "network": self.network.as_dict(),
        }


_TOP_LEVEL_KEYS = tuple(f for f in ClusterSpec.__dataclass_fields__ if f != "source")


def load_spec(path: Optional[str] = None) -> ClusterSpec:
    """The package defaults, with the user's file (`path`, else $ALPA_KIT_CLUSTER_SPEC) merged over."""
    defaults = _read_yaml(DEFAULT_SPEC_PATH, "the package's cluster.yaml")
    user_path = path or os.environ.get(SPEC_ENV_VAR) or None
    if user_path is None:
        return spec_from_dict(defaults, source="package defaults")
    overrides = _read_yaml(user_path, "cluster spec %s" % user_path)
    source = "%s (over the package defaults)" % user_path
    merged = _deep_merge(defaults, overrides, source, where="")
    return spec_from_dict(merged, source=source)


def spec_from_dict(raw: Mapping[str, Any], source: str = "a cluster spec") -> ClusterSpec:
    """Validate a complete spec mapping (cluster.yaml's layout) and freeze it."""
    raw = dict(raw)
    missing = [k for k in _TOP_LEVEL_KEYS if k not in raw]
    unknown = [k for k in raw if k not in _TOP_LEVEL_KEYS]
    if unknown:
        raise KitError("%s: unknown key(s) %s; allowed keys: %s" % (source, ", ".join(unknown), ", ".join(_TOP_LEVEL_KEYS)))
    if missing:
        raise KitError("%s: missing key(s) %s; add them" % (source, ", ".join(missing)))

    cluster_cidr = _ipv4_cidr(raw["cluster_cidr"], "cluster_cidr", source)
    admin_cidrs = tuple(_any_cidr(c, "admin_cidrs", source) for c in _list(raw["admin_cidrs"], "admin_cidrs", source))
    ports = {name: _port(value, "ports.%s" % name, source) for name, value in _mapping(raw["ports"], "ports", source).items()}
    ranges = {name: _range(value, "ranges.%s" % name, source) for name, value in _mapping(raw["ranges"], "ranges", source).items()}
    _require(ports, REQUIRED_PORTS, "ports", source)
    _require(ranges, REQUIRED_RANGES, "ranges", source)
    admin_ports = tuple(_list(raw["admin_ports"], "admin_ports", source))
    for name in admin_ports:
        if name not in ports and name not in ranges:
            raise KitError(
                "%s: admin_ports names %r, which is no port or range; use names from: %s"
                % (source, name, ", ".join(list(ports) + list(ranges)))
            )
    head_only = tuple(_list(raw["head_only_ports"], "head_only_ports", source))
    for name in head_only:
        if name not in ports:
            raise KitError("%s: head_only_ports names %r, which is no port; use names from: %s" % (source, name, ", ".join(ports)))
    _refuse_overlaps(ports, ranges, source)
    coordinator = _port(raw["jax_coordinator_port"], "jax_coordinator_port", source)
    xla_lo, xla_hi = ranges["xla_grpc"]
    if not xla_lo <= coordinator <= xla_hi:
        raise KitError(
            "%s: jax_coordinator_port %d lies outside range xla_grpc %d-%d; set it to a port inside "
            "that range (only that range is opened between members for it)" % (source, coordinator, xla_lo, xla_hi)
        )
    versions = _str_mapping(raw["versions"], "versions", source)
    _require(versions, REQUIRED_VERSIONS, "versions", source)
    images = _str_mapping(raw["images"], "images", source)
    network = network_from_dict(raw["network"], source)
    return ClusterSpec(
        cluster_cidr=cluster_cidr,
        admin_cidrs=admin_cidrs,
        admin_ports=admin_ports,
        ports=MappingProxyType(ports),
        ranges=MappingProxyType(ranges),
        head_only_ports=head_only,
        jax_coordinator_port=coordinator,
        versions=MappingProxyType(versions),
        images=MappingProxyType(images),
        network=network,
        source=source,
    )


def _read_yaml(path: str, label: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise KitError("%s: file not found; check the path (or %s)" % (label, SPEC_ENV_VAR)) from None
    except yaml.YAMLError as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise KitError("%s is not valid YAML (%s); fix the syntax" % (label, first_line)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise KitError("%s must be a YAML mapping (key: value lines), not a %s" % (label, type(data).__name__))
    return data


def _deep_merge(base: Dict[str, Any], override: Mapping[str, Any], source: str, where: str) -> Dict[str, Any]:
    """`base` with `override`'s keys replaced; nested mappings merge, lists and scalars replace."""
    merged = dict(base)
    for key, value in override.items():
        if key not in base:
            raise KitError(
                "%s: unknown key %s%s; allowed keys%s: %s"
                % (source, where, key, " under " + where.rstrip(".") if where else "", ", ".join(map(str, base)))
            )
        if isinstance(base[key], dict) and isinstance(value, dict):
            merged[key] = _deep_merge(base[key], value, source, where + str(key) + ".")
        else:
            merged[key] = value
    return merged


def _refuse_overlaps(ports: Mapping[str, int], ranges: Mapping[str, Tuple[int, int]], source: str) -> None:
    """Two plan entries sharing a port means two daemons fight for it (or a range hands it out)."""
    spans = [PortSpan(n, p, p) for n, p in ports.items()] + [PortSpan(n, lo, hi) for n, (lo, hi) in ranges.items()]
    for i, a in enumerate(spans):
        for b in spans[i + 1 :]:
            if not a.overlaps(b):
                continue
            if not a.is_range and not b.is_range:
                problem = "%s and %s both use %d" % (a.name, b.name, a.lo)
            elif a.is_range and b.is_range:
                problem = "ranges %s %s and %s %s overlap" % (a.name, a.text(), b.name, b.text())
            else:
                port, rng = (a, b) if b.is_range else (b, a)
                problem = "%s %d lies inside range %s %s" % (port.name, port.lo, rng.name, rng.text())
            raise KitError("port plan: %s; move one of them (%s)" % (problem, source))


def _require(have: Mapping[str, Any], names: Tuple[str, ...], section: str, source: str) -> None:
    missing = [n for n in names if n not in have]
    if missing:
        raise KitError("%s: %s lacks %s; add them" % (source, section, ", ".join(missing)))


def _mapping(value: Any, key: str, source: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise KitError("%s: %s must be a mapping of name: value, not %r" % (source, key, value))
    return {str(k): v for k, v in value.items()}


def _str_mapping(value: Any, key: str, source: str) -> Dict[str, str]:
    out = {}
    for name, item in _mapping(value, key, source).items():
        if not isinstance(item, str):
            # `ray_modern: 2.60` unquoted is the float 2.6: refuse rather than guess.
            raise KitError('%s: %s.%s must be a quoted string, e.g. "%s"' % (source, key, name, item))
        out[name] = item
    return out


def _list(value: Any, key: str, source: str) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise KitError("%s: %s must be a list of strings, not %r" % (source, key, value))
    return list(value)


def _port(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise KitError("%s: %s is %r; a port must be a whole number from 1 to 65535" % (source, key, value))
    return value


def _range(value: Any, key: str, source: str) -> Tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise KitError("%s: %s is %r; write a range as [first, last] (both inclusive)" % (source, key, value))
    lo, hi = _port(value[0], key, source), _port(value[1], key, source)
    if lo > hi:
        raise KitError("%s: %s is [%d, %d]; the first port must not exceed the last" % (source, key, lo, hi))
    return lo, hi


def _ipv4_cidr(value: Any, key: str, source: str) -> str:
    network = _network(value, key, source)
    if network.version != 4:
        # Ray/Alpa match `node:<IP>` resources with an IPv4 pattern: node IPs must be IPv4.
        raise KitError("%s: %s %s is IPv6; Ray and Alpa need an IPv4 cluster network" % (source, key, value))
    return str(network)


def _any_cidr(value: Any, key: str, source: str) -> str:
    return str(_network(value, key, source))


def _network(value: Any, key: str, source: str) -> ipaddress._BaseNetwork:
    if not isinstance(value, str):
        raise KitError("%s: %s must be a CIDR string such as 10.0.0.0/8, not %r" % (source, key, value))
    try:
        return ipaddress.ip_network(value, strict=True)
    except ValueError as err:
        hint = ""
        try:
            hint = "; did you mean %s" % ipaddress.ip_network(value, strict=False)
        except ValueError:
            pass
        raise KitError("%s: %s %r is not a network CIDR (%s)%s" % (source, key, value, err, hint)) from None
