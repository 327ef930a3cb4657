"""Running the kit's playbooks (`alpa_job cluster up|down`, site.yml / teardown.yml) against a test bed's
hosts and reading what they did: the Ansible tests and bench/ansible_site.py share it.

``Ansible(ssh_bed)``: inventories for a plain bed reached over ``sshd.SshBed``, runs from inside the head;
``SiteAnsible(site_bed)``: inventories from ansible/inventory/example.yml for a ``site_bed.SiteBed``, runs
from the site's controller.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Optional

import yaml

from kit_testbed.hosts import REPO_ROOT as REPO

ANSIBLE_DIR = REPO / "ansible"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
ACTIONS = {"site.yml": "up", "teardown.yml": "down"}
CONTAINER = "alpa-kit-ray"


def played(summary: dict) -> str:
    """Ansible's own (uncoloured) output of the run, from ansible-runner's artifacts."""
    return Path(summary["artifact_dir"], "stdout").read_text(errors="replace")


def failure_lines(summary: dict) -> str:
    return "\n".join("%s: %s%s" % (f["host"], "UNREACHABLE: " if f.get("unreachable") else "", f["message"]) for f in summary["failures"])


def cluster_cli(bed, *args, host: str = "head", timeout: float = 120, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """`python -m alpa_job cluster ARGS...` inside `host` of the bed (the bridge has no address outside)."""
    return bed.exec(
        host, str(VENV_PYTHON), "-m", "alpa_job", "cluster", *map(str, args), timeout=timeout, check=False, cwd=str(REPO), env=env
    )


class Ansible:
    """Writes inventories for the ssh bed and runs `alpa_job cluster up|down` inside the head host."""

    def __init__(self, sb):
        self.sb = sb
        self.bed = sb.testbed
        self.work = self.bed.state_dir / "ansible"
        self.work.mkdir(exist_ok=True)
        self.token_file = self.work / "ray_auth_token"
        self.runs = 0

    def host_vars(self, name: str, ip: str) -> dict:
        etc = self.bed.host_dir(name) if name in self.bed.ips else self.work / name
        return {
            "ansible_host": ip,
            # The hosts share the machine's filesystem: every node gets its own /etc-like paths.
            "alpa_kit_config_dir": str(etc / "etc" / "alpa-kit"),
            "ray_node_prep_sysctl_file": str(etc / "etc" / "sysctl.d" / "90-alpa-kit.conf"),
            "ray_node_prep_limits_file": str(etc / "etc" / "limits.d" / "90-alpa-kit.conf"),
            "ray_firewall_persist_conf": str(etc / "etc" / "nftables.conf"),
        }

    def inventory(self, name: str, heads, workers, file_vars: dict = None) -> Path:
        d = self.work / name
        d.mkdir(exist_ok=True)
        vars_ = {
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(self.sb.key),
            "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectTimeout=3",
            "ansible_python_interpreter": str(VENV_PYTHON),
            "ray_runtime": "process",
            "ray_cluster_python": str(VENV_PYTHON),
            "ray_cluster_python_manage": False,
            "ray_cluster_num_cpus": 2,
            "ray_cluster_object_store_memory": 200_000_000,
            # Test bed only: the GCS asks each raylet every second (Ray's default: every 3 s), so a raylet a
            # test kills is listed dead in ~5 s, not ~15 s.
            "ray_cluster_env_extra": {"PYTHONPATH": str(REPO), "RAY_health_check_period_ms": "1000"},
            "ray_cluster_auth_token_file": str(self.token_file),
        }
        vars_.update(file_vars or {})  # the inventory FILE's vars beat the kit's (role) defaults

        def hosts(pairs):
            return {n: self.host_vars(n, ip) for n, ip in pairs}

        children = {"ray_head": {"hosts": hosts(heads) or None}, "ray_workers": {"hosts": hosts(workers) or None}}
        inv = {"ray_cluster": {"children": children, "vars": vars_}}
        path = d / "hosts.yml"
        path.write_text(yaml.safe_dump(inv, sort_keys=False))
        return path

    def good_inventory(self) -> Path:
        ips = self.bed.ips
        return self.inventory("good", [("head", ips["head"])], [(n, ips[n]) for n in ("w1", "w2")])

    def run(self, playbook: str, inventory: Path, *extra, timeout: float = 500):
        """(the CLI's CompletedProcess, its summary.json as a dict)."""
        self.runs += 1
        run_dir = self.work / ("run-%d-%s" % (self.runs, playbook.split(".")[0]))
        p = self.cluster(ACTIONS[playbook], "-i", inventory, "--run-dir", run_dir, "--timeout", int(timeout) - 10, *extra, timeout=timeout)
        summary_file = run_dir / "summary.json"
        assert summary_file.exists(), (p.stdout + p.stderr)[-4000:]
        return p, json.loads(summary_file.read_text())

    def cluster(self, *args, timeout: float = 120) -> subprocess.CompletedProcess:
        """`python -m alpa_job cluster ARGS...` in the head (where an operator on a node runs it)."""
        return cluster_cli(
            self.bed,
            *args,
            timeout=timeout,
            # own ControlPersist sockets: the default ~/.ansible/cp names a socket by
            # host+port+user only, so another test bed's 10.77.0.2 would answer ours
            env={
                "ANSIBLE_HOME": str(self.work / "home"),
                "ANSIBLE_FORCE_COLOR": "0",
                "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.work / "home" / "cp"),
                "ANSIBLE_NOCOLOR": "1",
            },
        )

    def ray_processes(self) -> dict:
        out = {}
        for h in self.bed.hosts:
            p = self.bed.exec(h.name, "pgrep", "-a", "-x", "raylet|gcs_server", check=False)
            out[h.name] = p.stdout.strip()
        return out

    def nft_tables(self) -> dict:
        return {h.name: self.bed.exec(h.name, "nft", "list", "tables").stdout for h in self.bed.hosts}


class SiteAnsible:
    """Inventories from inventory/example.yml for the site bed, and playbooks run on the controller."""

    def __init__(self, site):
        self.site = site
        self.bed = site.testbed
        self.work = self.bed.state_dir / "ansible-docker"
        self.work.mkdir(exist_ok=True)
        self.token_file = self.work / "ray_auth_token"
        self.runs = 0

    def etc(self, node: str) -> Path:
        return self.bed.host_dir(node) / "etc"

    def ray_dir(self, node: str) -> Path:
        return self.bed.host_dir(node) / "var-lib-alpa-kit-ray"

    def host_vars(self, node: str, ip: str) -> dict:
        etc = self.etc(node)
        return {
            "ansible_host": ip,
            # test bed only: one dockerd per node, each behind its own socket
            "alpa_kit_docker_host": self.site.docker_sockets[node],
            # test bed only: the hosts share the machine's filesystem, so every node gets its own paths
            "alpa_kit_config_dir": str(etc / "alpa-kit"),
            "ray_node_prep_sysctl_file": str(etc / "sysctl.d" / "90-alpa-kit.conf"),
            "ray_node_prep_limits_file": str(etc / "limits.d" / "90-alpa-kit.conf"),
            "ray_firewall_persist_conf": str(etc / "nftables.conf"),
            "ray_cluster_host_ray_dir": str(self.ray_dir(node)),
        }

    def inventory(self, name: str, overrides: dict = None, heads=None) -> Path:
        example = yaml.safe_load((ANSIBLE_DIR / "inventory" / "example.yml").read_text())
        group = example["ray_cluster"]
        vars_ = dict(group["vars"])
        assert vars_["ray_runtime"] == "docker" and vars_["ray_stack"] == "jax"  # the defaults under test
        vars_.update(
            {
                "alpa_kit_registry": self.site.registry,  # the site's registry (the example's placeholder)
                "alpa_kit_cluster_cidr": self.site.cluster_cidr,
                # test bed only:
                "alpa_kit_registry_insecure": True,  # plain HTTP on the admin network
                "ray_gpus": False,  # CPU nodes: images.jax_cpu, no device_requests
                "ansible_ssh_private_key_file": str(self.site.ssh.key),
                "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectTimeout=5",
                "ansible_python_interpreter": str(VENV_PYTHON),  # community.docker needs `requests` on the node
                "ray_cluster_shm_size": "1g",
                "ray_cluster_nofile": 20000,
                "ray_cluster_memlock": "",  # the sandbox's hard limits
                "ray_cluster_num_cpus": 2,
                "ray_cluster_object_store_memory": 200_000_000,
                "ray_cluster_auth_token_file": str(self.token_file),
            }
        )
        vars_.update(overrides or {})
        nodes = list(self.site.nodes.items())
        head_names = heads or [nodes[0][0]]
        hv = {n: self.host_vars(n, ip) for n, ip in nodes}
        inv = {
            "ray_cluster": {
                "children": {
                    "ray_head": {"hosts": {n: hv[n] for n in head_names}},
                    "ray_workers": {"hosts": {n: hv[n] for n in hv if n not in head_names}},
                },
                "vars": vars_,
            }
        }
        d = self.work / name
        d.mkdir(exist_ok=True)
        path = d / "hosts.yml"
        path.write_text(yaml.safe_dump(inv, sort_keys=False))
        return path

    def run(self, playbook: str, inventory: Path, *extra, fresh_ssh: bool = False, timeout: float = 500):
        """`alpa_job cluster up|down` (site.yml, teardown.yml) on the controller, another playbook through
        run_playbook (what the CLI calls) -> (CompletedProcess, the run's summary.json as a dict).
        fresh_ssh: a new ANSIBLE_HOME, so no ControlPersist master of an earlier run is reused: every
        connection is new and must pass the nodes' firewalls."""
        self.runs += 1
        home = self.work / ("home-%d" % self.runs if fresh_ssh else "home")
        # Our own ControlPersist sockets: Ansible's default dir is ~/.ansible/cp whatever ANSIBLE_HOME says,
        # and a socket is named by host+port+user only, so another test bed's 10.77.0.2 would answer ours.
        env = {
            "ANSIBLE_HOME": str(home),
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(home / "cp"),
            "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_NOCOLOR": "1",
        }
        run_dir = self.work / ("run-%d-%s" % (self.runs, Path(playbook).stem))
        limit = str(int(timeout) - 10)  # the play stops (and summary.json is written) before exec's timeout
        if playbook in ACTIONS:
            cmd = [
                "-m",
                "alpa_job",
                "cluster",
                ACTIONS[playbook],
                "-i",
                str(inventory),
                "--run-dir",
                str(run_dir),
                "--timeout",
                limit,
                *extra,
            ]
        else:
            assert not extra, extra
            cmd = [
                "-c",
                "import sys; from alpa_job.cluster.control.playbook import run_playbook; "
                "s = run_playbook(sys.argv[1], sys.argv[2], run_dir=sys.argv[3], "
                "timeout_s=float(sys.argv[4])); sys.exit(0 if s.ok else 3)",
                playbook,
                str(inventory),
                str(run_dir),
                limit,
            ]
        p = self.bed.exec(self.site.controller, str(VENV_PYTHON), *cmd, cwd=str(REPO), timeout=timeout, check=False, env=env)
        summary_file = run_dir / "summary.json"
        assert summary_file.exists(), (p.stdout + p.stderr)[-4000:]
        return p, json.loads(summary_file.read_text())

    # ---- what is on the nodes ---------------------------------------------------------------------
    def containers(self) -> dict:
        return {n: self.site.docker(n, "ps", "-a", "--format", "{{.Names}} {{.ID}} {{.State}}").stdout.strip() for n in self.site.nodes}

    def images(self) -> dict:
        return {n: sorted(self.site.docker(n, "images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()) for n in self.site.nodes}

    def tables(self) -> dict:
        return {n: self.bed.exec(n, "nft", "list", "tables").stdout for n in self.site.nodes}

    def our_table(self, node: str) -> str:
        p = self.bed.exec(node, "nft", "list", "table", "inet", "alpa_kit", check=False)
        return p.stdout if p.returncode == 0 else ""

    def files(self) -> dict:
        return {
            n: sorted(str(p.relative_to(self.etc(n))) for p in self.etc(n).rglob("*")) if self.etc(n).exists() else []
            for n in self.site.nodes
        }
