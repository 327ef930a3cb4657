"""A user's site on the test bed (scripts/kit_testbed/site_layer.py, fixture ``site_bed``):
a controller outside the cluster CIDR that reaches every node, a real dockerd in every node that
pulls the kit's CPU image from the registry on the controller, and a teardown that leaves nothing."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kit_testbed import hosts as testbed_lib
from kit_testbed import site_layer as testbed_site
from fixtures_testbed import PREFIX

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

REPO = Path(__file__).resolve().parent.parent
CLI = REPO / "scripts" / "testbed"


def test_controller_reaches_every_node_from_outside_the_cluster_cidr(site_bed):
    bed = site_bed.testbed
    cidr = ipaddress.ip_network(site_bed.cluster_cidr)
    assert ipaddress.ip_address(site_bed.controller_ip) not in cidr
    ctl_addrs = bed.exec("ctl", "ip", "-4", "-o", "addr").stdout
    assert f"inet {site_bed.controller_ip}/24" in ctl_addrs
    assert not [a for a in ctl_addrs.split() if "/" in a and ipaddress.ip_interface(a).ip in cidr]
    for name, ip in site_bed.nodes.items():
        # sshd on each node answers the controller; the node sees the controller's own address (no NAT)
        p = site_bed.ssh.ssh(name, "sh", "-c", "'hostname; echo $SSH_CONNECTION'", timeout=60)
        hostname, conn = p.stdout.split("\n", 1)
        assert hostname == name
        assert conn.split()[0] == site_bed.controller_ip and conn.split()[2] == ip
        # ... and through the ssh_config the fixture wrote (what Ansible uses)
        assert bed.exec("ctl", "ssh", "-F", str(site_bed.ssh.ssh_config), name, "hostname").stdout.strip() == name
    # Still nothing leaves the machine: no default route on the controller, the router or a node.
    for host in ("ctl", "head"):
        p = bed.exec(host, "ip", "route", "get", "192.0.2.2", check=False)
        assert p.returncode != 0 and "unreachable" in p.stderr.lower()
    rtr = subprocess.run(["ip", "-n", f"{bed.prefix}-rtr", "route", "show", "default"], capture_output=True, text=True, timeout=10)
    assert rtr.returncode == 0 and rtr.stdout.strip() == ""


def test_every_dockerd_knows_the_controllers_registry_and_one_pulls_and_runs_the_image(site_bed):
    """Every node's dockerd trusts the controller's registry; w1 pulls the pushed image and runs it. One pull
    is enough here: site.yml's docker runtime pulls into every node's dockerd and test_ansible_docker checks
    each of them (three pulls of the image at once take a minute of the machine's two cores)."""
    bed = site_bed.testbed
    assert site_bed.registry.startswith(site_bed.controller_ip + ":")
    assert site_bed.image == f"{site_bed.registry}/{site_bed.image_tag}"
    # the registry lists the image (asked from a node: the path the pulls take)
    repo, tag = site_bed.image_tag.rsplit(":", 1)
    tags = json.loads(bed.exec("w1", "curl", "-sSf", f"http://{site_bed.registry}/v2/{repo}/tags/list").stdout)
    assert tag in tags["tags"]
    for node in site_bed.nodes:
        info = json.loads(site_bed.docker(node, "info", "--format", "{{json .}}").stdout)
        assert info["Name"] == node and site_bed.registry in json.dumps(info["RegistryConfig"]), node

    site_bed.docker("w1", "pull", "-q", site_bed.image, timeout=600)
    try:
        seen = site_bed.docker(
            "w1",
            "run",
            "--rm",
            "--network",
            "host",
            site_bed.image,
            "python",
            "-c",
            "import socket, ray; print(socket.gethostname(), ray.__version__)",
        ).stdout.split()
    finally:  # leave the session's site as it was: nothing pulled (site.yml's pull must do the work)
        site_bed.docker("w1", "rmi", "-f", site_bed.image, check=False)
    from alpa_job.cluster.spec import load_spec

    assert seen == ["w1", load_spec().versions["ray_modern"]]  # host network: the node's own hostname


def _alive(pids):
    return [p for p in pids if testbed_lib.pid_alive(p)]


def test_cli_site_down_stops_every_daemon_and_leaves_no_mount(testbed, tmp_path):
    """`scripts/testbed up --site --docker --registry` then `down`: containers removed, every dockerd and
    the registry stopped by PID, no process, mount, netns, link or exec-root of that bed left."""
    missing = testbed_site.missing_site_requirements(image=False)
    if missing:
        pytest.skip("; ".join(missing))
    # The fixtures name their beds PREFIX, PREFIX1, PREFIX2, ... (one per shape); 99 never collides with
    # them and still matches the session-start sweep of leftovers (PREFIX + digits).
    prefix = f"{PREFIX}99"
    state = tmp_path / "bed"
    base = [sys.executable, str(CLI), "--prefix", prefix, "--state-dir", str(state)]

    def run(*a, timeout=120):
        return subprocess.run(base + list(a), capture_output=True, text=True, timeout=timeout, cwd=str(REPO))

    pids = []
    try:
        up = run("up", "--hosts", "2", "--site", "--docker", "--registry")
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        info = json.loads(up.stdout)
        assert info["controller"]["ip"] == testbed_lib.CONTROLLER_IP
        site = info["site"]
        pids = [d["pid"] for d in site["docker"].values()] + [site["registry"]["pid"]]
        assert len(_alive(pids)) == 3
        # a running container on w1 (a small image made from the cached Debian base, if there is one)
        base_tar = testbed_site.IMAGE_CACHE / "debian-bookworm-minbase.tar"
        containers = 0
        if base_tar.exists():
            sock = site["docker"]["w1"]["socket"]
            p = run(
                "exec",
                "w1",
                "--",
                "sh",
                "-c",
                f"{testbed_site.DOCKER_CLI} -H {sock} import {base_tar} t/base:1 >/dev/null && "
                f"{testbed_site.DOCKER_CLI} -H {sock} run -d --network host t/base:1 sleep 4242424",
                timeout=300,
            )
            assert p.returncode == 0, p.stderr
            containers = 1
            testbed_lib.wait_for(lambda: _live_sleep(), 20, "the container's sleep")
        mounts_before = Path("/proc/mounts").read_text()
    finally:
        down = run("down", timeout=180)
    assert down.returncode == 0, down.stderr
    removed = json.loads(down.stdout)["removed"]
    assert f"dockerd w1: {containers} containers removed, stopped" in removed, removed
    assert "registry: stopped" in removed and "dockerd head: 0 containers removed, stopped" in removed
    assert not _alive(pids) and not _live_sleep()
    assert not os.path.exists(f"/run/{prefix}-docker")
    mounts = Path("/proc/mounts").read_text()
    assert str(state) not in mounts and f"{prefix}-" not in mounts and f"/run/{prefix}-docker" not in mounts
    assert str(state) not in mounts_before  # the hosts' mounts (overlay, cgroups) never were the machine's
    assert not [n for n in testbed_lib.list_netns() if n.startswith(prefix + "-")]
    assert not [n for n in testbed_lib.list_links() if n.startswith(prefix + "-")]
    assert not state.exists()


def _live_sleep():
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and b"sleep\x004242424" in _cmd(d) and testbed_lib.pid_alive(int(d))]


def _cmd(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
