"""Rendering the Ansible roles with Ansible's own Templar (the role tests). Running the playbooks against a
test bed's hosts is the bed's: kit_testbed/ansible_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ANSIBLE_DIR = REPO / "ansible"
ROLES = ANSIBLE_DIR / "roles"


# ---- rendering with Ansible's Templar -------------------------------------------------------------
_PLUGINS_READY = False


class Render:
    """Ansible's Templar over alpa_kit's + one role's defaults, inventory vars, facts and role vars."""

    def __init__(self, runtime: str, role: str = "worker", supervisor: str = "daemon", kit_role: str = "ray_cluster", **host_vars):
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
        self.role_dir = ROLES / kit_role
        ips = {"head": "10.0.0.1", "w1": "10.0.0.2"}
        me = "head" if role == "head" else "w1"

        def load(path):
            return self.loader.load_from_file(str(path), trusted_as_template=True) or {}

        variables = {}
        variables.update(load(ROLES / "alpa_kit" / "defaults" / "main.yml"))  # role defaults: lowest
        variables.update(load(self.role_dir / "defaults" / "main.yml"))
        variables.update(
            {
                "inventory_hostname": me,
                "playbook_dir": str(ANSIBLE_DIR),
                "groups": {"ray_head": ["head"], "ray_workers": ["w1"], "all": ["head", "w1"]},
                "hostvars": {n: {"ray_node_prep_node_ip": ip} for n, ip in ips.items()},
                "ray_node_prep_node_ip": ips[me],
                "ray_node_prep_node_iface": "ens5",
                "ansible_facts": {"service_mgr": "systemd" if supervisor == "systemd" else "tini", "os_family": "Debian"},
                "ray_runtime": runtime,
                "ray_cluster_auth_token": "tok3n",
                "ray_cluster_num_gpus": 8,
                "ansible_managed": "managed",
            }
        )
        variables.update(host_vars)  # inventory vars beat role defaults
        variables.update(load(self.role_dir / "vars" / "main.yml"))
        for os_vars in ("Debian.yml",):
            if (self.role_dir / "vars" / os_vars).exists():
                variables.update(load(self.role_dir / "vars" / os_vars))
        self.templar = Templar(loader=self.loader, variables=variables)

    def var(self, name):
        return self.templar.template(self.templar.available_variables[name])

    def tasks(self, tasks_file: str) -> list:
        return self.loader.load_from_file(str(self.role_dir / "tasks" / tasks_file), trusted_as_template=True)

    def task(self, tasks_file: str, name_start: str) -> dict:
        return next(t for t in self.tasks(tasks_file) if t["name"].startswith(name_start))

    def task_args(self, tasks_file: str, module: str, name_start: str = "") -> dict:
        task = next(t for t in self.tasks(tasks_file) if module in t and t["name"].startswith(name_start))
        return self.templar.template(task[module])

    def template_file(self, name: str) -> str:
        from ansible.template import trust_as_template

        return self.templar.template(trust_as_template((self.role_dir / "templates" / name).read_text()))
