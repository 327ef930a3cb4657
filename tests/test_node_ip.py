"""Node IP selection: given address maps, this machine's real interfaces, with and without iproute2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from alpa_job.cluster import node_ip
from alpa_job.cluster.node_ip import local_ipv4_addresses, select_node_ip
from alpa_job.errors import KitError

REPO = Path(__file__).resolve().parents[1]


def test_the_one_interface_inside_the_cidr_wins():
    addresses = {"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "eth0": ["10.1.2.3"], "ib0": ["192.168.50.3"]}
    assert select_node_ip("10.0.0.0/8", addresses) == "10.1.2.3"
    assert select_node_ip("192.168.50.0/24", addresses) == "192.168.50.3"


def test_no_interface_inside_the_cidr():
    with pytest.raises(KitError) as err:
        select_node_ip("10.0.0.0/8", {"eth0": ["192.168.1.5"], "lo": ["127.0.0.1"]})
    assert str(err.value) == (
        "no interface of this host has an address in cluster CIDR 10.0.0.0/8 "
        "(found: eth0=192.168.1.5, lo=127.0.0.1); set cluster_cidr in your cluster spec "
        "to the network your nodes share"
    )


def test_several_interfaces_inside_the_cidr():
    with pytest.raises(KitError) as err:
        select_node_ip("10.0.0.0/8", {"eth0": ["10.1.0.5"], "ib0": ["10.2.0.5"], "lo": ["127.0.0.1"]})
    message = str(err.value)
    assert message.startswith("several interfaces of this host have an address in cluster CIDR 10.0.0.0/8")
    assert "eth0=10.1.0.5, ib0=10.2.0.5" in message and "lo=" not in message
    assert "pick one by narrowing cluster_cidr" in message
    # Narrowing the CIDR, as the message says, resolves it.
    assert select_node_ip("10.2.0.0/16", {"eth0": ["10.1.0.5"], "ib0": ["10.2.0.5"]}) == "10.2.0.5"


def test_one_interface_with_several_addresses_inside_the_cidr():
    with pytest.raises(KitError, match="interface eth0 has several addresses in cluster CIDR 10.0.0.0/8"):
        select_node_ip("10.0.0.0/8", {"eth0": ["10.0.0.5", "10.0.0.6"]})
    assert select_node_ip("10.0.0.5/32", {"eth0": ["10.0.0.5", "10.0.0.6"]}) == "10.0.0.5"


def test_bad_cidr_and_empty_host():
    with pytest.raises(KitError, match="is not a network"):
        select_node_ip("10.0.0.0/33", {"eth0": ["10.0.0.5"]})
    with pytest.raises(KitError, match="found: no IPv4 addresses at all"):
        select_node_ip("10.0.0.0/8", {})


def test_real_host_has_loopback_and_selects_it():
    addresses = local_ipv4_addresses()
    assert "127.0.0.1" in addresses.get("lo", [])
    assert select_node_ip("127.0.0.0/8") == "127.0.0.1"


@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 (`ip`) is not installed here")
def test_iproute2_and_the_ioctl_fallback_agree_on_this_host():
    from_ip = node_ip._addresses_from_iproute2()
    from_ioctl = node_ip._addresses_from_ioctl()
    assert from_ip is not None
    assert set(from_ip) == set(from_ioctl)
    for iface, ips in from_ioctl.items():
        assert ips[0] in from_ip[iface]  # the ioctl sees the primary address only


def _python(code_or_module_args, env=None, netns=None):
    argv = [sys.executable] + code_or_module_args
    if netns:
        argv = ["ip", "netns", "exec", netns] + argv
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)


def test_works_without_iproute2(tmp_path):
    """With no `ip` on PATH (slim images) the addresses come from the kernel directly."""
    env = dict(os.environ, PATH=str(tmp_path))  # an empty directory: no `ip` to find
    done = _python(
        [
            "-c",
            "import json; from alpa_job.cluster.node_ip import *; "
            "import shutil; assert shutil.which('ip') is None; "
            "print(json.dumps(local_ipv4_addresses()))",
        ],
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "127.0.0.1" in json.loads(done.stdout)["lo"]


def test_cli_prints_the_ip_or_a_one_line_error(tmp_path):
    done = _python(["-m", "alpa_job.cluster.node_ip", "--cidr", "127.0.0.0/8"])
    assert (done.returncode, done.stdout) == (0, "127.0.0.1\n")
    spec = tmp_path / "c.yaml"
    spec.write_text("cluster_cidr: 127.0.0.0/8\n")
    done = _python(["-m", "alpa_job.cluster.node_ip", "--spec", str(spec)])
    assert (done.returncode, done.stdout) == (0, "127.0.0.1\n")
    done = _python(["-m", "alpa_job.cluster.node_ip", "--cidr", "198.51.100.0/24"])  # TEST-NET-2
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: no interface of this host has an address in cluster CIDR 198.51.100.0/24")


def _netns_usable():
    return os.geteuid() == 0 and shutil.which("ip") is not None


@pytest.mark.testbed
@pytest.mark.skipif(not _netns_usable(), reason="needs root and iproute2 to create a network namespace")
def test_in_a_namespace_with_one_cluster_interface(tmp_path):
    """A throw-away netns whose eth0 has 10.99.0.1/24: both code paths pick it from 10.99.0.0/24."""
    ns = "akip%s" % uuid.uuid4().hex[:8]
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        # A veth pair inside the namespace (no dummy module here); only eth0 gets an address.
        for cmd in (
            ["link", "add", "eth0", "type", "veth", "peer", "name", "eth1"],
            ["addr", "add", "10.99.0.1/24", "dev", "eth0"],
            ["link", "set", "eth0", "up"],
            ["link", "set", "lo", "up"],
        ):
            subprocess.run(["ip", "-n", ns] + cmd, check=True)
        done = _python(["-m", "alpa_job.cluster.node_ip", "--cidr", "10.99.0.0/24"], netns=ns)
        assert (done.returncode, done.stdout) == (0, "10.99.0.1\n"), done.stderr
        no_ip = dict(os.environ, PATH=str(tmp_path))
        done = subprocess.run(
            [shutil.which("ip"), "netns", "exec", ns, sys.executable, "-m", "alpa_job.cluster.node_ip", "--list"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env=no_ip,
        )
        assert json.loads(done.stdout) == {"eth0": ["10.99.0.1"], "lo": ["127.0.0.1"]}, done.stderr
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
