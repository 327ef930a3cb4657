"""The Ansible tree is lint-clean (ansible-lint production profile, yamllint), its plan equals the
kit's cluster.yaml, and the docker runtime's container runs the same `ray start` as the process
runtime (rendered with Ansible's own Templar from the role's vars and templates; no SSH, no Docker)."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ANSIBLE_DIR = REPO / "ansible"
BIN = Path(sys.executable).parent


def _tool(name):
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not path:
        pytest.skip("%s not installed (scripts/setup --test installs requirements/dev.txt)" % name)
    return str(path)


def test_yamllint_clean():
    p = subprocess.run([_tool("yamllint"), "-s", "-f", "parsable", "."], cwd=ANSIBLE_DIR, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_ansible_lint_production_profile_clean(tmp_path):
    env = dict(os.environ, ANSIBLE_HOME=str(tmp_path / "home"), NO_COLOR="1", ANSIBLE_LINT_NODEPS="0",
               PATH=str(BIN) + os.pathsep + os.environ.get("PATH", ""))
    p = subprocess.run([_tool("ansible-lint"), "--profile", "production", "--offline", "-q"], cwd=ANSIBLE_DIR,
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-4000:]


def test_group_vars_plan_equals_cluster_yaml():
    import yaml

    from alpa_job.cluster.spec import load_spec

    group_vars = yaml.safe_load((ANSIBLE_DIR / "group_vars" / "all.yml").read_text())
    plan = {k[len("alpa_kit_"):]: v for k, v in group_vars.items() if k.startswith("alpa_kit_") and k != "alpa_kit_spec"}
    assert plan == load_spec().as_dict()
    # alpa_kit_spec (what the filters take) names every key of the plan, each from its own variable
    assert group_vars["alpa_kit_spec"] == {k: "{{ alpa_kit_%s }}" % k for k in plan}


_PLUGINS_READY = False


# ---- the docker runtime's container spec vs the process runtime, rendered by Ansible ---------------
class Render:
    """Ansible's Templar over the ray_cluster role's defaults + group_vars + host facts + role vars."""

    def __init__(self, runtime: str, role: str = "worker", supervisor: str = "daemon", **host_vars):
        pytest.importorskip("ansible")
        from ansible.parsing.dataloader import DataLoader
        from ansible.plugins.loader import filter_loader, init_plugin_loader
        from ansible.template import Templar

        global _PLUGINS_READY
        if not _PLUGINS_READY:
            init_plugin_loader()
            _PLUGINS_READY = True
        filter_loader.add_directory(str(ANSIBLE_DIR / "filter_plugins"))
        self.loader = DataLoader()
        role_dir = ANSIBLE_DIR / "roles" / "ray_cluster"
        self.role_dir = role_dir
        ips = {"head": "10.0.0.1", "w1": "10.0.0.2"}
        me = "head" if role == "head" else "w1"
        variables = {}
        variables.update(self.loader.load_from_file(str(role_dir / "defaults" / "main.yml"), trusted_as_template=True))
        variables.update(self.loader.load_from_file(str(ANSIBLE_DIR / "group_vars" / "all.yml"), trusted_as_template=True))
        variables.update({
            "inventory_hostname": me, "playbook_dir": str(ANSIBLE_DIR),
            "groups": {"ray_head": ["head"], "ray_workers": ["w1"], "all": ["head", "w1"]},
            "hostvars": {n: {"ray_node_prep_node_ip": ip} for n, ip in ips.items()},
            "ray_node_prep_node_ip": ips[me], "ray_node_prep_node_iface": "ens5",
            "ansible_facts": {"service_mgr": "systemd" if supervisor == "systemd" else "tini", "os_family": "Debian"},
            "ray_runtime": runtime, "ray_cluster_auth_token": "tok3n", "ray_cluster_num_gpus": 8,
            "ansible_managed": "managed",
        })
        variables.update(host_vars)
        variables.update(self.loader.load_from_file(str(role_dir / "vars" / "main.yml"), trusted_as_template=True))
        self.templar = Templar(loader=self.loader, variables=variables)

    def var(self, name):
        return self.templar.template(self.templar.available_variables[name])

    def task_args(self, tasks_file: str, module: str) -> dict:
        tasks = self.loader.load_from_file(str(self.role_dir / "tasks" / tasks_file), trusted_as_template=True)
        task = next(t for t in tasks if module in t)
        return self.templar.template(task[module])

    def template_file(self, name: str) -> str:
        from ansible.template import trust_as_template

        return self.templar.template(trust_as_template((self.role_dir / "templates" / name).read_text()))


@pytest.mark.parametrize("role", ["head", "worker"])
def test_docker_container_runs_the_same_ray_start_as_the_process_runtime(role):
    from alpa_job.cluster.ray_start import ray_start_args
    from alpa_job.cluster.spec import load_spec

    docker = Render("docker", role=role)
    container = docker.task_args("docker.yml", "community.docker.docker_container")
    process = Render("process", role=role, supervisor="daemon")
    daemon_start = process.task_args("process-daemon.yml", "ansible.builtin.command")  # the pgrep check
    assert daemon_start["argv"][0] == "pgrep"
    start_argv = process.var("__ray_cluster_start_argv")
    systemd = Render("process", role=role, supervisor="systemd")
    unit = systemd.template_file("alpa-kit-ray.service.j2")
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))[len("ExecStart="):]

    # One argv: the kit's renderer with this node's IP; foreground (--block) in the container and the
    # systemd unit, daemonised by the process runtime without a service manager.
    want = ray_start_args(load_spec(), role, "10.0.0.1" if role == "head" else "10.0.0.2", head_ip="10.0.0.1",
                          num_gpus=8, block=True)
    assert list(container["command"]) == want
    assert list(start_argv) + ["--block"] == want
    argv = shlex.split(exec_start)
    assert os.path.basename(argv[0]) == "ray" and argv[1:] == want[1:]

    assert container["network_mode"] == "host"
    assert container["shm_size"] == "16g"
    assert container["image"] == "alpa-cluster-kit/jax:0.10.2-cuda12.8-py3.11"
    assert list(container["device_requests"]) == [{"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}]
    env = dict(container["env"])
    assert env == {k: v for k, v in process.var("__ray_cluster_process_env").items() if k not in ("PATH", "VIRTUAL_ENV")}
    assert env["NCCL_SOCKET_IFNAME"] == "ens5"
    assert (env["XLA_SERVER_PORT_START"], env["XLA_SERVER_PORT_END"]) == ("20000", "25000")
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN"]) == ("token", "tok3n")  # Ray 2.60 >= 2.52
    assert env["ALPA_KIT_CLUSTER_SPEC"] == "/etc/alpa-kit/cluster.yaml"
    mounts = {m["target"]: m for m in container["mounts"]}
    assert mounts["/etc/alpa-kit"]["source"] == "/etc/alpa-kit" and mounts["/etc/alpa-kit"]["read_only"]
    assert mounts["/tmp/ray"]["source"] == "/var/lib/alpa-kit/ray"


def test_docker_runtime_without_gpus_and_legacy_ray_has_no_token_or_device_requests():
    r = Render("docker", ray_gpus=False, ray_cluster_ray_version="2.1.0")
    container = r.task_args("docker.yml", "community.docker.docker_container")
    assert list(container["device_requests"]) == []
    assert container["image"] == "alpa-cluster-kit/jax:0.10.2-cpu-py3.11"
    assert not any(k.startswith("RAY_AUTH") for k in container["env"])
    assert not any(a.startswith("--runtime-env-agent-port") for a in container["command"])  # Ray 2.1.0 flag set
