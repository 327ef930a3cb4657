"""This node's Ray IP: the address of the ONE local interface inside the cluster CIDR.

Ray's own guess is the source address of the route to 8.8.8.8 (head) or to the head (worker); on hosts
with several NICs (docker0, InfiniBand, management) that can be the wrong network, and Alpa then
binds XLA servers on an address other nodes cannot reach. So the node IP is chosen from the spec's
cluster_cidr, and an ambiguous or empty match is an error rather than a guess.

CLI: python -m alpa_job.cluster.node_ip [--cidr 10.0.0.0/8 | --spec FILE] [--list]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from typing import Dict, List, Mapping, Optional, Sequence

from alpa_job.errors import KitError

SIOCGIFADDR = 0x8915  # linux/sockios.h: get an interface's (primary) IPv4 address
SYS_CLASS_NET = "/sys/class/net"


def local_ipv4_addresses() -> Dict[str, List[str]]:
    """{interface: [IPv4 addresses]} of this host, interfaces without IPv4 left out.

    Uses `ip -j addr` when iproute2 is installed (it lists secondary addresses too); otherwise, as on
    slim container images, asks the kernel per interface with the SIOCGIFADDR ioctl.
    """
    if shutil.which("ip"):
        found = _addresses_from_iproute2()
        if found is not None:
            return found
    return _addresses_from_ioctl()


def _addresses_from_iproute2() -> Optional[Dict[str, List[str]]]:
    """Parse `ip -j -4 addr show`; None if this `ip` cannot produce JSON (very old iproute2)."""
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, timeout=10, check=True).stdout
        links = json.loads(out or "[]")
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    found: Dict[str, List[str]] = {}
    for link in links:
        ips = [a["local"] for a in link.get("addr_info", []) if a.get("family") == "inet" and a.get("local")]
        if ips and link.get("ifname"):
            found.setdefault(link["ifname"], []).extend(ips)
    return found


def _interface_names() -> List[str]:
    try:
        return sorted(os.listdir(SYS_CLASS_NET))
    except OSError:
        return sorted(name for _, name in socket.if_nameindex())


def _addresses_from_ioctl() -> Dict[str, List[str]]:
    """One (the primary) IPv4 address per interface, straight from the kernel; no tools needed."""
    import fcntl  # Linux/Unix only; imported here so the module still imports elsewhere

    found: Dict[str, List[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in _interface_names():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:  # EADDRNOTAVAIL: the interface has no IPv4 address
                continue
            # struct ifreq: 16 bytes of name, then a sockaddr_in whose address sits at bytes 4..8.
            found[name] = [socket.inet_ntoa(reply[20:24])]
    return found


def ips_in_cidr(ips: Sequence[str], cidr: str) -> List[str]:
    """The addresses among `ips` that lie inside `cidr` (order kept); KitError if `cidr` is not a network.

    The one membership test for a host's addresses (node-IP choice here, the doctor's node check);
    ClusterSpec.cluster_ipv4 is the refusing form for one address the user gave.
    """
    try:
        network = ipaddress.ip_network(str(cidr), strict=False)
    except ValueError:
        raise KitError("cluster CIDR %r is not a network such as 10.0.0.0/8; fix cluster_cidr" % (cidr,)) from None
    return [ip for ip in ips if ipaddress.ip_address(ip) in network]


def select_node_ip(cidr: str, addresses: Optional[Mapping[str, Sequence[str]]] = None) -> str:
    """The address of the one interface with an address inside `cidr` (KitError if none or several)."""
    ips_in_cidr([], cidr)  # a bad CIDR fails before the interfaces are read
    network = ipaddress.ip_network(str(cidr), strict=False)
    if addresses is None:
        addresses = local_ipv4_addresses()
    inside = {}
    for iface, ips in addresses.items():
        matching = ips_in_cidr(ips, cidr)
        if matching:
            inside[iface] = matching
    if not inside:
        raise KitError(
            "no interface of this host has an address in cluster CIDR %s (found: %s); set cluster_cidr "
            "in your cluster spec to the network your nodes share" % (network, _describe(addresses))
        )
    if len(inside) > 1:
        raise KitError(
            "several interfaces of this host have an address in cluster CIDR %s (%s); pick one by "
            "narrowing cluster_cidr in your cluster spec to the network your nodes share" % (network, _describe(inside))
        )
    ((iface, ips),) = inside.items()
    if len(ips) > 1:
        raise KitError(
            "interface %s has several addresses in cluster CIDR %s (%s); pick one by narrowing "
            "cluster_cidr in your cluster spec" % (iface, network, ", ".join(ips))
        )
    return ips[0]


def _describe(addresses: Mapping[str, Sequence[str]]) -> str:
    pairs = ["%s=%s" % (iface, ip) for iface in sorted(addresses) for ip in addresses[iface]]
    return ", ".join(pairs) if pairs else "no IPv4 addresses at all"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m alpa_job.cluster.node_ip",
        description="Print this host's address inside the cluster CIDR (the value for --node-ip-address).",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--cidr", help="cluster CIDR (default: cluster_cidr of the cluster spec)")
    source.add_argument("--spec", help="cluster spec YAML merged over the defaults (default: $ALPA_KIT_CLUSTER_SPEC)")
    parser.add_argument("--list", action="store_true", help="print every interface's IPv4 addresses as JSON instead")
    opts = parser.parse_args(argv)
    if opts.list:
        print(json.dumps(local_ipv4_addresses(), indent=2, sort_keys=True))
        return 0
    try:
        cidr = opts.cidr
        if cidr is None:
            from alpa_job.cluster.spec import load_spec  # only needed (with its yaml import) here

            cidr = load_spec(opts.spec).cluster_cidr
        print(select_node_ip(cidr))
    except KitError as err:
        print("error: %s" % err, file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
