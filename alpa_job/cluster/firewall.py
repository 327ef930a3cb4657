"""nftables rules and sysctl lines for a node, rendered from the cluster spec.

The rules open every planned port and range to cluster members only (head-only ports on the head only)
and the admin ports to admin_cidrs, and refuse everything else *fast*: TCP gets a reset and UDP an
ICMP port-unreachable, never a silent drop, so a port missing from the plan shows up as an immediate
"connection refused" instead of XLA's `DEADLINE_EXCEEDED` minutes later.

Only our own table is touched: loading the file first creates-then-deletes `table inet alpa_kit`, so
`nft -f` of it is idempotent and leaves other tables (Docker's, the distribution's) alone.
`log` output is not visible on every host, so dynamic sets with counters record what was accepted and
refused: `nft list set inet alpa_kit rejected_tcp`.

CLI: python -m alpa_job.cluster.firewall --node-ip X --members A,B,C --role worker [--spec FILE]
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import sys
from typing import Iterable, List, Optional, Sequence

from alpa_job.cluster.spec import ClusterSpec, PortSpan, load_spec
from alpa_job.errors import KitError

ROLES = ("head", "worker")
_TABLE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,30}$")
# 65536 elements hold every possible port, so an `add @set` in an accept rule can never fail for a
# full set (a failed add would skip that rule's accept and fall through to the reject).
_PORT_SET_SIZE = 65536


def render_nftables(
    spec: ClusterSpec,
    node_ip: str,
    member_ips: Iterable[str],
    role: str,
    table: str = "alpa_kit",
    member_ports: Optional[Sequence[PortSpan]] = None,
    source: Optional[str] = None,
) -> str:
    """The nft script (for `nft -f`) that firewalls this node's input to the cluster's port plan.

    `member_ports` replaces the spec's port plan for members (e.g. the ports of a Kubernetes
    NetworkPolicy, alpa_job.cluster.netpol); `source` then names where they came from.
    """
    if role not in ROLES:
        raise KitError("role must be 'head' or 'worker', not %r" % (role,))
    if not _TABLE_NAME.match(table):
        raise KitError("nft table name %r must be a letter then letters, digits or _ (at most 31)" % (table,))
    node_ip = _cluster_ip(spec, node_ip, "node IP")
    # A node is always a member of its own cluster; this also keeps the set from being empty.
    members = sorted({_cluster_ip(spec, ip, "member IP") for ip in member_ips} | {node_ip}, key=ipaddress.ip_address)
    admin_v4 = [c for c in spec.admin_cidrs if ipaddress.ip_network(c).version == 4]
    admin_v6 = [c for c in spec.admin_cidrs if ipaddress.ip_network(c).version == 6]
    admin_ports = spec.admin_tcp_ports(role)

    out = [
        "#!/usr/sbin/nft -f",
        "# alpa-cluster-kit firewall for %s %s, rendered from %s." % (role, node_ip, source or "the cluster spec (%s)" % spec.source),
        "# Do not edit: re-render it. Loading it replaces table inet %s and touches nothing else." % table,
        "table inet %s {}" % table,  # create it if absent, so the delete below never fails ...
        "delete table inet %s" % table,  # ... and the new table replaces the old one atomically
        "",
        "table inet %s {" % table,
        "\t# Every cluster member's Ray IP.",
        "\tset members {",
        "\t\ttype ipv4_addr",
        "\t\telements = { %s }" % ", ".join(members),
        "\t}",
    ]
    if admin_v4:
        out += _interval_set("admin_v4", "ipv4_addr", admin_v4)
    if admin_v6:
        out += _interval_set("admin_v6", "ipv6_addr", admin_v6)
    out += [
        "",
        "\t# What came in and what was refused, per port, with counters (`nft list set inet %s NAME`)." % table,
        "\tset accepted_tcp { type inet_service; flags dynamic; size %d; counter; }" % _PORT_SET_SIZE,
        "\tset rejected_tcp { type inet_service; flags dynamic; size %d; counter; }" % _PORT_SET_SIZE,
        "\tset rejected_udp { type inet_service; flags dynamic; size %d; counter; }" % _PORT_SET_SIZE,
        "\tset rejected_tcp_from { type ipv4_addr . inet_service; flags dynamic; size %d; counter; }" % _PORT_SET_SIZE,
        "",
        "\tchain input {",
        "\t\ttype filter hook input priority filter; policy accept;",
        '\t\tiif "lo" accept',
        "\t\tct state established,related accept",
        "\t\tmeta l4proto { icmp, ipv6-icmp } accept",
        # DHCP replies are not matched by conntrack (the request went to broadcast): keep leases working.
        '\t\tudp sport 67 udp dport 68 accept comment "dhcp client"',
        '\t\tudp sport 547 udp dport 546 accept comment "dhcpv6 client"',
    ]
    for span in spec.member_tcp_ports(role) if member_ports is None else member_ports:
        out.append('\t\tip saddr @members tcp dport %s add @accepted_tcp { tcp dport } accept comment "%s"' % (span.text(), span.name))
    if admin_ports:
        ports = _port_set(admin_ports)
        comment = "admin: %s" % ", ".join(s.name for s in admin_ports)
        if admin_v4:
            out.append('\t\tip saddr @admin_v4 tcp dport %s accept comment "%s"' % (ports, comment))
        if admin_v6:
            out.append('\t\tip6 saddr @admin_v6 tcp dport %s accept comment "%s"' % (ports, comment))
    out += [
        # A separate rule: `ip saddr` only matches IPv4, and the reject below must catch IPv6 too.
        "\t\tmeta nfproto ipv4 meta l4proto tcp add @rejected_tcp_from { ip saddr . tcp dport }",
        '\t\tmeta l4proto tcp add @rejected_tcp { tcp dport } counter reject with tcp reset comment "not planned"',
        '\t\tmeta l4proto udp add @rejected_udp { udp dport } counter reject with icmpx port-unreachable comment "not planned"',
        "\t}",
        "}",
        "",
    ]
    return "\n".join(out)


def render_sysctl(spec: ClusterSpec) -> str:
    """/etc/sysctl.d/ lines every node needs (load with `sysctl -p FILE` or `sysctl --system`)."""
    lines = [
        "# alpa-cluster-kit, rendered from the cluster spec (%s). Do not edit: re-render it." % spec.source,
        "# NCCL and gloo listen on ephemeral ports; pin them to the range the firewall opens.",
    ]
    lines += ["%s = %s" % (key, value) for key, value in spec.sysctl().items()]
    return "\n".join(lines) + "\n"


def _interval_set(name: str, kind: str, cidrs: List[str]) -> List[str]:
    return [
        "\tset %s {" % name,
        "\t\ttype %s" % kind,
        "\t\tflags interval",
        "\t\telements = { %s }" % ", ".join(cidrs),
        "\t}",
    ]


def _port_set(spans: List[PortSpan]) -> str:
    return "{ %s }" % ", ".join(s.text() for s in spans)


def _cluster_ip(spec: ClusterSpec, ip: str, what: str) -> str:
    return spec.cluster_ipv4(ip, what, "list the members' cluster IPv4 addresses", "list the nodes' cluster addresses or fix cluster_cidr")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m alpa_job.cluster.firewall",
        description="Print the nftables ruleset (for `nft -f`) for this node, from the cluster spec.",
    )
    parser.add_argument("--node-ip", required=True, help="this node's address inside cluster_cidr")
    parser.add_argument("--members", required=True, help="comma-separated IPs of every cluster node")
    parser.add_argument("--role", required=True, choices=ROLES)
    parser.add_argument("--spec", help="cluster spec YAML merged over the defaults (default: $ALPA_KIT_CLUSTER_SPEC)")
    parser.add_argument("--table", default="alpa_kit", help="nft table name (inet family)")
    parser.add_argument("--sysctl", action="store_true", help="print the sysctl.d lines instead of the ruleset")
    opts = parser.parse_args(argv)
    try:
        spec = load_spec(opts.spec)
        members = [m for m in (p.strip() for p in opts.members.split(",")) if m]
        text = render_nftables(spec, opts.node_ip, members, opts.role, table=opts.table)
        if opts.sysctl:
            text = render_sysctl(spec)
    except KitError as err:
        print("error: %s" % err, file=sys.stderr)
        return err.exit_code
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
