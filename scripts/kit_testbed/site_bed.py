"""A started site seen as one object: the bed's nodes and controller, the daemons ``site_layer.start_site``
started on them, and sshd from ``sshd.SshBed``, as the ``site_bed`` fixture and bench/ansible_site.py
hand them to the Ansible runs (``ansible_runs.SiteAnsible``)."""

from __future__ import annotations

import subprocess

from kit_testbed import hosts as tb
from kit_testbed import site_layer
from kit_testbed.hosts import Testbed


class SiteBed:
    """What ``site_bed`` gives (everything a site.yml run from an outside controller needs).

    ``.testbed`` (Testbed; ``.exec(host, ...)`` runs on a node or, with ``"ctl"``, on the controller),
    ``.controller`` ("ctl"), ``.controller_ip`` ("10.78.0.2"), ``.admin_subnet`` ("10.78.0.0/24"),
    ``.router_ip`` (the nodes' next hop to the admin subnet, "10.77.0.254"), ``.cluster_cidr``
    ("10.77.0.0/24"), ``.nodes`` {name: ip} (head first), ``.docker_sockets`` {node: "unix:///run/<p>-docker/
    <node>.sock"}, ``.dockerd_pids`` {node: pid seen from outside}, ``.registry`` ("10.78.0.2:5000"),
    ``.registry_pid``, ``.image`` (pushed ref "10.78.0.2:5000/alpa-cluster-kit/jax:..."), ``.image_tag``
    (spec ``images.jax_cpu``), ``.ssh`` (SshBed: ``.key``, ``.ssh_config``, ``.ssh(node, *cmd)`` from the
    controller), ``.docker(node, *args, timeout=120, check=True)`` -> CompletedProcess (docker CLI
    against that node's dockerd, run inside the node), ``.on_controller(*cmd, **kw)`` = exec on ctl.
    """

    def __init__(self, bed: Testbed, site: dict, ssh):
        self.testbed = bed
        self.controller = bed.controller.name
        self.controller_ip = bed.controller.ip
        self.admin_subnet = tb.ADMIN_SUBNET
        self.router_ip = bed.router_ip
        self.cluster_cidr = bed.subnet
        self.nodes = bed.ips
        self.docker_sockets = {n: d["socket"] for n, d in site["docker"].items()}
        self.dockerd_pids = {n: d["pid"] for n, d in site["docker"].items()}
        self.registry = site["registry"]["address"]
        self.registry_pid = site["registry"]["pid"]
        self.image = site["image"]["ref"]
        self.image_tag = site_layer.cpu_image_tag()
        self.ssh = ssh

    def docker(self, node: str, *args, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return site_layer.docker(self.testbed, node, *args, timeout=timeout, check=check)

    def on_controller(self, *cmd, **kw) -> subprocess.CompletedProcess:
        return self.testbed.exec(self.controller, *cmd, **kw)
