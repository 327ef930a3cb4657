"""The Ansible tree is lint-clean (ansible-lint production profile, yamllint), reads its plan from the
kit's cluster.yaml (no copy; inventory vars win), and what it renders is right: the docker runtime's
container runs the same `ray start` as the process runtime, `ray_stack` moves image and Ray version
together, the container's user owns what it writes, the firewall admits the controller or the play
stops, and the ruleset is persisted through the distribution's nftables config. Rendering uses
Ansible's own Templar over the roles' defaults/vars/tasks (no SSH, no Docker); one test runs a real
ansible-playbook against localhost to show an inventory-file var beating the defaults."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers_ansible import Render

REPO = Path(__file__).resolve().parent.parent
ANSIBLE_DIR = REPO / "ansible"
ROLES = ANSIBLE_DIR / "roles"
BIN = Path(sys.executable).parent


def _tool(name):
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not path:
        pytest.skip("%s not installed (scripts/setup --test installs requirements/dev.txt)" % name)
    return str(path)


def test_yamllint_clean():
    p = subprocess.run([_tool("yamllint"), "-s", "-f", "parsable", "."], cwd=ANSIBLE_DIR, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_ansible_lint_production_profile_clean(tmp_path):
    env = dict(
        os.environ,
        ANSIBLE_HOME=str(tmp_path / "home"),
        NO_COLOR="1",
        ANSIBLE_LINT_NODEPS="0",
        PATH=str(BIN) + os.pathsep + os.environ.get("PATH", ""),
    )
    p = subprocess.run(
        [_tool("ansible-lint"), "--profile", "production", "--offline", "-q"],
        cwd=ANSIBLE_DIR,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-4000:]


# ---- settings: the plan comes from cluster.yaml, inventory vars win --------------------------------
def test_the_plan_is_read_from_cluster_yaml_not_copied():
    from alpa_job.cluster.spec import load_spec

    assert not (ANSIBLE_DIR / "group_vars").exists()  # playbook group_vars beat inventory-file vars
    plan = load_spec().as_dict()
    defaults = yaml.safe_load((ROLES / "alpa_kit" / "defaults" / "main.yml").read_text())
    # every cluster.yaml key is a documented setting alpa_kit_<key>, whose default is the file's value
    for key in plan:
        assert defaults["alpa_kit_" + key] == "{{ __alpa_kit_file_plan.%s }}" % key
    # ... and no literal of the plan is spelled anywhere in the tree (no port, no version, no tag)
    texts = "\n".join(p.read_text() for p in ANSIBLE_DIR.rglob("*.yml"))
    for literal in (plan["versions"]["ray_modern"], plan["images"]["jax"], str(plan["ports"]["dashboard"]), plan["versions"]["jax_modern"]):
        assert literal not in texts, literal
    assert Render("docker").var("alpa_kit_spec") == plan


def _playbook_run(tmp_path, inventory: dict, playbook: list):
    """ansible-playbook against localhost (connection local) with the kit's roles and filters."""
    pytest.importorskip("ansible")
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    (tmp_path / "play.yml").write_text(yaml.safe_dump(playbook, sort_keys=False))
    (tmp_path / "ansible.cfg").write_text("[defaults]\n")  # none of the machine's settings
    env = dict(
        os.environ,
        ANSIBLE_HOME=str(tmp_path / "home"),
        ANSIBLE_ROLES_PATH=str(ROLES),
        ANSIBLE_FILTER_PLUGINS=str(ANSIBLE_DIR / "filter_plugins"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_STDOUT_CALLBACK="ansible.builtin.json",
        ANSIBLE_CONFIG=str(tmp_path / "ansible.cfg"),
        PATH=str(BIN) + os.pathsep + os.environ.get("PATH", ""),
    )
    p = subprocess.run(
        [_tool("ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    out = json.loads(p.stdout)
    return {t["task"]["name"]: t["hosts"]["node1"] for t in out["plays"][0]["tasks"]}


def test_inventory_file_vars_beat_the_kit_defaults(tmp_path):
    """alpa_kit_cluster_cidr (and a partial alpa_kit_ports) typed in the inventory FILE take effect."""
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {
        "ray_cluster": {
            "children": {"ray_head": {"hosts": {"node1": local}}, "ray_workers": {"hosts": {}}},
            "vars": {
                "alpa_kit_cluster_cidr": "192.168.50.0/24",
                "alpa_kit_ports": {"dashboard": 8266},
                "ray_stack": "alpa",
                "alpa_kit_registry": "reg.example:5000",
            },
        }
    }
    shown = {"spec": "{{ alpa_kit_spec }}", "image": "{{ alpa_kit_image }}", "ray": "{{ alpa_kit_ray_version }}"}
    playbook = [
        {
            "name": "Show the settings.",
            "hosts": "ray_head",
            "gather_facts": False,
            "roles": ["alpa_kit"],
            "tasks": [{"name": "show", "ansible.builtin.debug": {"msg": shown}}],
        }
    ]
    got = _playbook_run(tmp_path, inventory, playbook)["show"]["msg"]
    from alpa_job.cluster.spec import load_spec

    plan = load_spec().as_dict()
    assert got["spec"]["cluster_cidr"] == "192.168.50.0/24"
    assert got["spec"]["ports"] == dict(plan["ports"], dashboard=8266)  # merged key by key
    assert got["spec"]["ranges"] == plan["ranges"]
    assert got["image"] == "reg.example:5000/" + plan["images"]["alpa"]
    assert got["ray"] == plan["versions"]["ray_legacy"]


def test_requirements_pin_the_collections_the_tree_uses():
    import re

    import ansible_collections

    reqs = yaml.safe_load((ANSIBLE_DIR / "requirements.yml").read_text())["collections"]
    pinned = {c["name"]: c["version"] for c in reqs}
    text = "\n".join(p.read_text() for p in ANSIBLE_DIR.rglob("*.yml") if p.name != "requirements.yml")
    used = set(re.findall(r"^\s*-?\s*((?!ansible\.builtin)[a-z_]+\.[a-z_]+)\.[a-z_]+:", text, re.M))
    assert used == set(pinned), (used, pinned)
    for name, version in pinned.items():  # the `ansible` package's copy (not ansible-core's internal one)
        found = [Path(b).joinpath(*name.split(".")) / "MANIFEST.json" for b in ansible_collections.__path__]
        manifest = json.loads(next(f for f in found if f.exists()).read_text())
        assert manifest["collection_info"]["version"] == version, name


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
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))[len("ExecStart=") :]

    # One argv: the kit's renderer with this node's IP; foreground (--block) in the container and the
    # systemd unit, daemonised by the process runtime without a service manager.
    want = ray_start_args(load_spec(), role, "10.0.0.1" if role == "head" else "10.0.0.2", head_ip="10.0.0.1", num_gpus=8, block=True)
    assert list(container["command"]) == want
    assert list(start_argv) + ["--block"] == want
    argv = shlex.split(exec_start)
    assert os.path.basename(argv[0]) == "ray" and argv[1:] == want[1:]

    assert container["network_mode"] == "host"
    assert container["shm_size"] == "16g"
    # No registry set: the bare tag, which must already be on the nodes (image source "present").
    assert container["image"] == load_spec().images["jax"] and container["pull"] == "never"
    assert docker.var("alpa_kit_image_source") == "present"
    # GPU options are rendered and asserted only (no NVIDIA runtime here).
    assert list(container["device_requests"]) == [{"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}]
    assert list(container["ulimits"]) == ["nofile:65536:65536", "memlock:-1:-1"]
    env = dict(container["env"])
    assert env == {k: v for k, v in process.var("__ray_cluster_process_env").items() if k not in ("PATH", "VIRTUAL_ENV")}
    assert env["NCCL_SOCKET_IFNAME"] == "ens5"
    assert (env["XLA_SERVER_PORT_START"], env["XLA_SERVER_PORT_END"]) == ("20000", "25000")
    # Ray 2.60 >= 2.52: token auth, the token as a 0400 file on the node, never its value in the env
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN_PATH"]) == ("token", "/etc/alpa-kit/ray_auth_token")
    assert "tok3n" not in json.dumps(env) and "RAY_AUTH_TOKEN" not in env
    assert env["ALPA_KIT_RAY_TOKEN_SHA256"] == hashlib.sha256(b"tok3n").hexdigest()  # a new token restarts Ray
    placed = docker.task_args("main.yml", "ansible.builtin.copy", "Place the Ray token")
    assert (placed["dest"], placed["mode"], str(placed["owner"])) == ("/etc/alpa-kit/ray_auth_token", "0400", "1000")
    assert placed["content"].strip() == "tok3n"
    assert env["ALPA_KIT_CLUSTER_SPEC"] == "/etc/alpa-kit/cluster.yaml"
    mounts = {m["target"]: m for m in container["mounts"]}
    assert mounts["/etc/alpa-kit"]["source"] == "/etc/alpa-kit" and mounts["/etc/alpa-kit"]["read_only"]
    assert mounts["/tmp/ray"]["source"] == "/var/lib/alpa-kit/ray"


def test_the_container_user_owns_every_host_directory_it_writes():
    r = Render("docker", ray_cluster_container_user="1234:2345", ray_cluster_host_ray_dir="/srv/ray-logs")
    container = r.task_args("docker.yml", "community.docker.docker_container")
    assert container["user"] == "1234:2345"
    writable = [m for m in container["mounts"] if not m.get("read_only")]
    assert [m["target"] for m in writable] == ["/tmp/ray"]  # the config dir is read-only
    made = r.task_args("docker.yml", "ansible.builtin.file", "Ensure Ray's log directory")
    assert (made["path"], str(made["owner"]), str(made["group"])) == ("/srv/ray-logs", "1234", "2345")
    assert made["path"] == writable[0]["source"]
    # The default is the kit images' USER line (docker/*/Dockerfile: USER 1000:1000).
    assert Render("docker").var("ray_cluster_container_user") == "1000:1000"
    for dockerfile in ("jax", "alpa"):
        assert "\nUSER 1000:1000\n" in (REPO / "docker" / dockerfile / "Dockerfile").read_text()


@pytest.mark.parametrize("stack", ["jax", "alpa"])
def test_ray_stack_sets_image_and_ray_version_together(stack):
    from alpa_job.cluster.spec import load_spec

    spec = load_spec()
    r = Render("docker", ray_stack=stack, alpa_kit_registry="registry.site:5000/ml")
    container = r.task_args("docker.yml", "community.docker.docker_container")
    want_ray = spec.versions["ray_legacy" if stack == "alpa" else "ray_modern"]
    assert container["image"] == "registry.site:5000/ml/" + spec.images[stack]
    assert r.var("ray_cluster_ray_version") == want_ray
    assert r.var("alpa_kit_image_source") == "pull"  # a registry: the nodes pull
    flags = list(container["command"])
    assert (("--runtime-env-agent-port=%d" % spec.ports["runtime_env_agent"]) in flags) == (stack == "jax")
    env = dict(container["env"])
    assert ("RAY_AUTH_TOKEN_PATH" in env) == (stack == "jax")  # Ray 2.1.0 has no token auth
    packages = Render("process", ray_stack=stack).var("ray_cluster_python_packages")
    assert "ray[default]==%s" % want_ray in packages


def test_docker_runtime_without_gpus_uses_the_cpu_image_and_no_device_requests():
    from alpa_job.cluster.spec import load_spec

    r = Render("docker", ray_gpus=False, ray_cluster_memlock="", ray_cluster_nofile=20000)
    container = r.task_args("docker.yml", "community.docker.docker_container")
    assert list(container["device_requests"]) == []
    assert container["image"] == load_spec().images["jax_cpu"]
    assert list(container["ulimits"]) == ["nofile:20000:20000"]  # "" leaves memlock to the engine


# ---- the fabric: cluster.yaml's network section reaches the container --------------------------------
FABRICS = {  # alpa_kit_network as an inventory sets it (merged key by key over cluster.yaml's)
    "ethernet": {},
    "ib": {"fabric": "ib", "gbps": 400, "ib_hca": "mlx5_0:1,mlx5_1:1"},
    "roce": {"fabric": "roce", "gbps": 200, "ib_hca": "=mlx5_2", "ib_gid_index": 3},
}


def nccl_fabric_drift(env, spec) -> list:
    """Where a runtime's NCCL_IB_* and socket settings differ from what spec.nccl_env() renders for the fabric."""
    rendered = set(spec.network.socket_env())
    have = {k: v for k, v in env.items() if k.startswith("NCCL_IB_") or k in rendered}
    want = spec.nccl_env()
    return [
        "%s = %r, the fabric (%s) says %r" % (k, have.get(k), spec.network.fabric, want.get(k))
        for k in sorted(set(have) | set(want))
        if have.get(k) != want.get(k)
    ]


def _fabric_spec(network):
    from alpa_job.cluster.spec import load_spec, spec_from_dict

    plan = load_spec().as_dict()
    return spec_from_dict(dict(plan, network=dict(plan["network"], **network)), source="test")


@pytest.mark.parametrize("fabric", sorted(FABRICS))
def test_both_runtimes_set_the_nccl_env_the_fabric_renders(fabric):
    spec = _fabric_spec(FABRICS[fabric])
    docker = Render("docker", alpa_kit_network=FABRICS[fabric])
    assert docker.var("alpa_kit_spec")["network"] == spec.network.as_dict()
    env = dict(docker.task_args("docker.yml", "community.docker.docker_container")["env"])
    assert nccl_fabric_drift(env, spec) == []
    process = dict(Render("process", alpa_kit_network=FABRICS[fabric]).var("__ray_cluster_process_env"))
    assert nccl_fabric_drift(process, spec) == []
    assert env["NCCL_SOCKET_IFNAME"] == "ens5"  # NCCL's bootstrap stays on the cluster interface


def test_the_nccl_drift_check_fails_when_a_runtime_overrides_the_fabric():
    spec = _fabric_spec(FABRICS["ib"])
    r = Render("docker", alpa_kit_network=FABRICS["ib"], ray_cluster_env_extra={"NCCL_IB_DISABLE": "1"})
    env = dict(r.task_args("docker.yml", "community.docker.docker_container")["env"])
    assert nccl_fabric_drift(env, spec) == ["NCCL_IB_DISABLE = '1', the fabric (ib) says '0'"]
    ethernet = _fabric_spec({})
    assert nccl_fabric_drift(dict(ethernet.nccl_env(), NCCL_IB_HCA="mlx5_0"), ethernet) == [
        "NCCL_IB_HCA = 'mlx5_0', the fabric (ethernet) says None"
    ]


def test_the_nccl_drift_check_fails_when_a_runtime_lacks_the_socket_settings():
    spec = _fabric_spec({})
    env = dict(Render("process").var("__ray_cluster_process_env"))
    del env["NCCL_NSOCKS_PERTHREAD"]
    assert nccl_fabric_drift(env, spec) == ["NCCL_NSOCKS_PERTHREAD = None, the fabric (ethernet) says '4'"]


@pytest.mark.parametrize("fabric", ["ib", "roce"])
def test_an_rdma_fabric_hands_the_verbs_devices_ipc_lock_and_unlimited_memlock_to_the_container(fabric):
    # Rendered and asserted only: no InfiniBand or RoCE hardware here.
    r = Render("docker", alpa_kit_network=FABRICS[fabric], ray_cluster_memlock=65536)
    container = r.task_args("docker.yml", "community.docker.docker_container")
    assert list(container["devices"]) == ["/dev/infiniband"]
    assert list(container["capabilities"]) == ["IPC_LOCK"]
    assert list(container["ulimits"]) == ["nofile:65536:65536", "memlock:-1:-1"]  # pinned buffers: no limit
    assert container["network_mode"] == "host"


def test_ethernet_adds_no_device_capability_or_limit():
    r = Render("docker", ray_cluster_memlock="")
    container = r.task_args("docker.yml", "community.docker.docker_container")
    assert list(container["devices"]) == [] and list(container["capabilities"]) == []
    assert list(container["ulimits"]) == ["nofile:65536:65536"]


def test_an_unknown_fabric_stops_the_render_with_the_allowed_values():
    from ansible.errors import AnsibleError

    with pytest.raises(AnsibleError, match="network.fabric is 'infiniband'; use one of: ib, roce, ethernet"):
        Render("docker", alpa_kit_network={"fabric": "infiniband"}).var("__ray_cluster_env")


def test_image_reference_parts():
    sys.path.insert(0, str(ANSIBLE_DIR / "filter_plugins"))
    try:
        import alpa_kit as kit
    finally:
        sys.path.remove(str(ANSIBLE_DIR / "filter_plugins"))
    assert kit.image_ref("kit/jax:1.0", "10.78.0.1:5000/") == "10.78.0.1:5000/kit/jax:1.0"
    assert kit.image_parts("10.78.0.1:5000/kit/jax:1.0") == {
        "registry": "10.78.0.1:5000",
        "repository": "kit/jax",
        "tag": "1.0",
        "api_host": "10.78.0.1:5000",
        "manifest_path": "/v2/kit/jax/manifests/1.0",
    }
    hub = kit.image_parts("debian")
    assert (hub["api_host"], hub["manifest_path"]) == ("registry-1.docker.io", "/v2/library/debian/manifests/latest")
    assert kit.image_parts("localhost/x/y")["registry"] == "localhost"


def _kit_filters():
    sys.path.insert(0, str(ANSIBLE_DIR / "filter_plugins"))
    try:
        import alpa_kit
    finally:
        sys.path.remove(str(ANSIBLE_DIR / "filter_plugins"))
    return alpa_kit


@pytest.mark.parametrize(
    "controller, cidrs, auto, admit, error",
    [
        ("", [], True, [], ""),  # ansible_connection: local
        ("10.0.0.2", [], True, [], ""),  # a member
        ("127.0.0.1", [], True, [], ""),  # loopback
        ("192.168.1.9", [], True, [], ""),  # one of the node's own addresses
        ("172.16.5.5", [], True, ["172.16.5.5/32"], ""),  # outside: admitted by its own address
        ("172.16.5.5", ["172.16.0.0/16"], True, [], ""),  # inside admin_cidrs
        ("172.16.5.5", ["192.0.2.0/24"], True, [], "alpa_kit_admin_cidrs"),  # set and excluding: stop
        ("172.16.5.5", [], False, [], "alpa_kit_admin_cidrs"),  # auto off
        ("?", [], True, [], "alpa_kit_admin_cidrs"),  # unknown and nothing set: stop
        ("?", ["192.0.2.0/24"], True, [], ""),  # unknown but the operator set the CIDRs
    ],
)
def test_controller_admission(controller, cidrs, auto, admit, error):
    from alpa_job.cluster.spec import load_spec

    kit = _kit_filters()
    plan = dict(load_spec().as_dict(), admin_cidrs=cidrs)
    got = kit.controller_admission(controller, plan, ["10.0.0.1", "10.0.0.2"], ["192.168.1.9", "10.0.0.1"], auto=auto, host="w1")
    assert got["admit"] == admit
    if error:
        assert error in got["error"] and got["error"].startswith("host w1: ") and "\n" not in got["error"]
        if controller != "?":
            assert "Add %s/32 to alpa_kit_admin_cidrs" % controller in got["error"]
    else:
        assert got["error"] == ""


def test_firewall_admits_the_controller_found_and_persists_through_the_distribution_config(tmp_path):
    fw = Render(
        "docker", role="head", kit_role="ray_firewall", ray_node_prep_admin_extra=["172.16.5.5/32"], alpa_kit_config_dir=str(tmp_path)
    )
    ruleset = fw.var("__ray_firewall_ruleset")
    assert "elements = { 172.16.5.5/32 }" in ruleset
    assert 'ip saddr @admin_v4 tcp dport { 22, 8265 } accept comment "admin: ssh, dashboard"' in ruleset
    # Persistence: the distribution's config (Debian /etc/nftables.conf) includes the rendered file.
    assert fw.var("ray_firewall_persist_conf") == "/etc/nftables.conf"
    line = fw.var("__ray_firewall_include_line")
    assert line == 'include "%s/nftables-alpa_kit.nft"' % tmp_path
    persist = fw.task_args("nftables.yml", "ansible.builtin.lineinfile")
    assert persist["line"] == line and persist["validate"] == "nft -c -f %s" and persist["create"]
    names = [t["name"] for t in fw.tasks("nftables.yml")]
    assert names.index("Render the firewall from the port plan.") < names.index(
        "Include the rendered table from the distribution's nftables config (survives a reboot)."
    )
    removed = fw.task_args("teardown.yml", "ansible.builtin.lineinfile")
    assert removed["line"] == line and removed["state"] == "absent"
    # The real check: nft accepts a Debian-style nftables.conf that includes the rendered ruleset.
    nft = shutil.which("nft") or pytest.skip("nft not installed")
    (tmp_path / "nftables-alpa_kit.nft").write_text(ruleset)
    conf = tmp_path / "nftables.conf"
    conf.write_text(
        "#!/usr/sbin/nft -f\nflush ruleset\ntable inet filter {\n\tchain input {\n"
        "\t\ttype filter hook input priority filter;\n\t}\n}\n%s\n" % line
    )
    p = subprocess.run([nft, "-c", "-f", str(conf)], capture_output=True, text=True, timeout=30)
    if p.returncode != 0 and "Operation not permitted" in p.stderr:
        pytest.skip("nft -c needs CAP_NET_ADMIN")
    assert p.returncode == 0, p.stderr


def test_preflight_checks_come_before_every_change():
    """ray_node_prep: every check (CIDR, controller, Docker, image/registry) precedes its first change."""
    tasks = yaml.safe_load((ROLES / "ray_node_prep" / "tasks" / "main.yml").read_text())
    names = [t["name"] for t in tasks]
    first_change = names.index("Ensure the kit's config directory exists.")
    for check in (
        "Find this node's address in the cluster CIDR.",
        "Include the controller's admission check.",
        "Check Docker, the GPU stack and the image (docker runtime).",
    ):
        assert names.index(check) < first_change, check
    for sub in ("controller.yml", "docker.yml"):  # the included files only read and assert
        for t in yaml.safe_load((ROLES / "ray_node_prep" / "tasks" / sub).read_text()):
            module = next(k for k in t if "." in k)
            assert module.endswith(("assert", "set_fact", "_info", ".uri", ".stat", ".command")), (sub, module)
            if module.endswith(".command"):
                assert t["changed_when"] is False, t["name"]
    play = yaml.safe_load((ANSIBLE_DIR / "site.yml").read_text())[1]
    assert play["any_errors_fatal"] is True and play["roles"] == ["ray_node_prep", "ray_firewall"]
