"""The user's Ansible inventory as the kit's operations see it: nodes (SSH address, user, key, role) and the plan.

Ansible reads it (`ansible-inventory --list` through ansible-runner), so every inventory form Ansible
accepts works here too (YAML, INI, a directory with group_vars/host_vars, a plugin) and group vars
arrive merged into each host's vars. What Ansible does not do here is template: a value we need that is
a Jinja expression is refused with the variable's name (status/logs/preflight read plain values).

The plan is the role's: the package's cluster.yaml (`alpa_kit_cluster_spec_file` merged over it), then
each `alpa_kit_<key>` the inventory sets merged over that (ansible/filter_plugins/alpa_kit.py does the
same for the playbooks), taken from the head's vars.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from alpa_job.errors import KitError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ANSIBLE_DIR = os.path.join(REPO, "ansible")
DEFAULT_INVENTORY = os.path.join(ANSIBLE_DIR, "inventory", "hosts.yml")  # what ansible.cfg names
HEAD_GROUP, WORKER_GROUP = "ray_head", "ray_workers"
INVENTORY_TIMEOUT_S = 60
# Role defaults we need outside Ansible (ansible/roles/*/defaults/main.yml); the inventory's values win.
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
DEFAULT_HOST_RAY_DIR = "/var/lib/alpa-kit/ray"  # ray_cluster_host_ray_dir: the container's /tmp/ray
PROCESS_RAY_DIR = "/tmp/ray"  # the process runtime: Ray's own default temp dir
TOKEN_FILE_DEFAULT = os.path.join(ANSIBLE_DIR, "credentials", "ray_auth_token")


def tool_env() -> Dict[str, str]:
    """PATH with this interpreter's bin first: ansible-runner starts `ansible-*` by name, and those must be
    the venv's (its ansible-core, its alpa_job for the filter plugins), not whatever PATH finds first."""
    bindir = os.path.dirname(sys.executable)
    return {"PATH": bindir + os.pathsep + os.environ.get("PATH", "")}


@dataclass
class Node:
    """One host of the inventory: where SSH reaches it and what the play will make of it."""

    name: str
    role: str  # "head" | "worker"
    address: str  # ansible_host (else the name)
    user: Optional[str] = None
    port: int = 22
    key_file: Optional[str] = None
    password: Optional[str] = None
    local: bool = False  # ansible_connection: local
    python: str = "python3"
    vars: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def ip(self) -> Optional[str]:
        """The address as an IP (a name is resolved once; None when it does not resolve)."""
        try:
            return str(ipaddress.ip_address(self.address))
        except ValueError:
            try:
                return socket.gethostbyname(self.address)
            except OSError:
                return None

    def var(self, name: str, default: Any = None) -> Any:
        value = self.vars.get(name, default)
        if isinstance(value, str) and "{{" in value:
            raise KitError(
                "inventory: %s of host %s is a template (%s); the cluster commands read plain values: "
                "write the value itself in the inventory" % (name, self.name, value)
            )
        return value


class Inventory:
    """The nodes of ray_head + ray_workers, and the settings the kit's operations need from them."""

    def __init__(self, path: str, nodes: List[Node]):
        self.path = path
        self.nodes = nodes
        heads = [n for n in nodes if n.role == "head"]
        if len(heads) != 1:
            raise KitError(
                "inventory %s: group %s must hold exactly one host (the Ray head); it holds %d%s. Put one "
                "host under %s and every other node under %s (ansible/inventory/example.yml)"
                % (path, HEAD_GROUP, len(heads), (": " + ", ".join(n.name for n in heads)) if heads else "", HEAD_GROUP, WORKER_GROUP)
            )
        self.head = heads[0]
        self._spec = None

    @property
    def workers(self) -> List[Node]:
        return [n for n in self.nodes if n.role == "worker"]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KitError("inventory %s has no host %r (hosts: %s)" % (self.path, name, ", ".join(self.names())))

    def names(self) -> List[str]:
        return [n.name for n in self.nodes]

    def by_ip(self) -> Dict[str, str]:
        """{IP: host name} of the nodes whose address is (or resolves to) an IP."""
        out = {}
        for n in self.nodes:
            ip = n.ip()
            if ip:
                out[ip] = n.name
        return out

    # ---- the plan and the role settings ----------------------------------------------------------------
    def spec(self):
        """The ClusterSpec the play renders from: cluster.yaml (+ alpa_kit_cluster_spec_file) + alpa_kit_*."""
        if self._spec is None:
            from alpa_job.cluster import spec as spec_mod

            head = self.head
            base = spec_mod.load_spec(head.var("alpa_kit_cluster_spec_file") or None).as_dict()
            given = {}
            for key in base:
                name = "alpa_kit_" + key
                if name in head.vars:
                    given[key] = head.var(name)
            source = "inventory %s (alpa_kit_* vars)" % self.path
            merged = spec_mod._deep_merge(base, given, source, where="")  # the filter plugin's merge
            self._spec = spec_mod.spec_from_dict(merged, source=source)
        return self._spec

    @property
    def runtime(self) -> str:
        return str(self.head.var("ray_runtime", "docker"))

    @property
    def stack(self) -> str:
        return str(self.head.var("ray_stack", "jax"))

    @property
    def gpus(self) -> bool:
        value = self.head.var("ray_gpus", self.runtime == "docker")
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")

    def image(self) -> str:
        """The image reference the nodes run (alpa_kit_image, else <alpa_kit_registry>/<cluster.yaml tag>)."""
        explicit = self.head.var("alpa_kit_image")
        if explicit:
            return str(explicit)
        key = "alpa" if self.stack == "alpa" else ("jax" if self.gpus else "jax_cpu")
        tag = self.spec().images[key]
        registry = str(self.head.var("alpa_kit_registry") or "").strip().rstrip("/")
        return "%s/%s" % (registry, tag) if registry else tag

    def image_source(self) -> str:
        return str(self.head.var("alpa_kit_image_source") or ("pull" if self.head.var("alpa_kit_registry") else "present"))

    def docker_host(self, node: Node) -> str:
        return str(node.var("alpa_kit_docker_host") or DEFAULT_DOCKER_HOST)

    def ray_log_dir(self, node: Node) -> str:
        """Where Ray's logs of the current session are on that host (outside any container)."""
        if self.runtime == "docker":
            base = str(node.var("ray_cluster_host_ray_dir") or DEFAULT_HOST_RAY_DIR)
        else:
            base = str(node.var("ray_cluster_temp_dir") or PROCESS_RAY_DIR)
        return base.rstrip("/") + "/session_latest/logs"

    def auth_token(self) -> Optional[str]:
        """The Ray token a client needs (RAY_AUTH_TOKEN, else the play's token file), or None."""
        if os.environ.get("RAY_AUTH_TOKEN"):
            return os.environ["RAY_AUTH_TOKEN"].strip()
        path = self.head.vars.get("ray_cluster_auth_token_file") or TOKEN_FILE_DEFAULT
        path = str(path).replace("{{ playbook_dir }}", ANSIBLE_DIR)
        for candidate in (path, os.environ.get("RAY_AUTH_TOKEN_PATH") or ""):
            if candidate and "{{" not in candidate and os.path.isfile(candidate):
                with open(candidate) as f:
                    return f.read().strip() or None
        return None


def _python(interpreter: Any) -> str:
    """The node's Python for our probes: the inventory's interpreter, python3 for Ansible's auto modes."""
    text = str(interpreter or "").strip()
    return "python3" if not text or text.startswith("auto") else text


def _node(name: str, role: str, hv: Mapping[str, Any]) -> Node:
    def plain(key, default=None):
        value = hv.get(key, default)
        if isinstance(value, str) and "{{" in value:
            raise KitError("inventory: %s of host %s is a template (%s); write the value itself" % (key, name, value))
        return value

    connection = plain("ansible_connection")
    return Node(
        name=name,
        role=role,
        address=str(plain("ansible_host") or name),
        user=plain("ansible_user") or plain("ansible_ssh_user"),
        port=int(plain("ansible_port") or plain("ansible_ssh_port") or 22),
        key_file=plain("ansible_ssh_private_key_file") or plain("ansible_private_key_file"),
        password=plain("ansible_password") or plain("ansible_ssh_pass"),
        local=connection == "local",
        python=_python(plain("ansible_python_interpreter")),
        vars=dict(hv),
    )


def _members(data: Mapping[str, Any], group: str) -> List[str]:
    """Hosts of `group` and of its children, in Ansible's order, once each."""
    out: List[str] = []
    entry = data.get(group) or {}
    for h in entry.get("hosts") or []:
        if h not in out:
            out.append(h)
    for child in entry.get("children") or []:
        for h in _members(data, child):
            if h not in out:
                out.append(h)
    return out


def parse_inventory_json(data: Mapping[str, Any], path: str) -> Inventory:
    """An Inventory from `ansible-inventory --list` output."""
    hostvars = (data.get("_meta") or {}).get("hostvars") or {}
    heads, workers = _members(data, HEAD_GROUP), _members(data, WORKER_GROUP)
    both = sorted(set(heads) & set(workers))
    if both:
        raise KitError(
            "inventory %s: %s is in both %s and %s; a node is one or the other" % (path, ", ".join(both), HEAD_GROUP, WORKER_GROUP)
        )
    nodes = [_node(h, "head", hostvars.get(h) or {}) for h in heads]
    nodes += [_node(h, "worker", hostvars.get(h) or {}) for h in workers]
    if not nodes:
        raise KitError(
            "inventory %s has no hosts in %s / %s; copy ansible/inventory/example.yml and list your nodes"
            % (path, HEAD_GROUP, WORKER_GROUP)
        )
    return Inventory(path, nodes)


def load_inventory(path: Optional[str] = None, timeout_s: float = INVENTORY_TIMEOUT_S) -> Inventory:
    """Read `path` (default: ansible/inventory/hosts.yml, like ansible.cfg) with Ansible's own inventory code."""
    path = os.path.abspath(path or DEFAULT_INVENTORY)
    if not os.path.exists(path):
        raise KitError("inventory %s not found; copy ansible/inventory/example.yml there or pass --inventory FILE" % path)
    try:
        import ansible_runner
    except ImportError:
        raise KitError(
            "the cluster commands need ansible-runner on the controller: pip install -r requirements/dev.txt (scripts/setup --test)"
        ) from None
    env = dict(os.environ)
    env.update(tool_env())
    env["ANSIBLE_CONFIG"] = os.path.join(ANSIBLE_DIR, "ansible.cfg")
    # get_inventory runs `ansible-inventory --list` in a subprocess; PATH picks the venv's.
    saved = os.environ.get("PATH")
    os.environ["PATH"] = env["PATH"]
    try:
        out, err = ansible_runner.get_inventory(
            action="list",
            inventories=[path],
            response_format="json",
            quiet=True,
            timeout=int(timeout_s),
            playbook_dir=ANSIBLE_DIR,
            envvars={"ANSIBLE_CONFIG": env["ANSIBLE_CONFIG"]},
        )
    finally:
        if saved is not None:
            os.environ["PATH"] = saved
    data = out if isinstance(out, dict) else None
    if data is None:
        try:
            data = json.loads(out or "")
        except ValueError:
            data = None
    if not isinstance(data, dict):
        why = " ".join(str(err or out or "no output").split())[-400:]
        raise KitError("ansible-inventory could not read %s: %s; fix the file (ansible-inventory -i %s --list)" % (path, why, path))
    return parse_inventory_json(data, path)
