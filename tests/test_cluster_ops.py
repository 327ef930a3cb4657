"""`python -m alpa_job cluster up|down|status|logs|preflight` (alpa_job/cluster/control) on the test bed, for real:
sshd in 3 hosts (ssh_bed) for preflight and the fabric paths, and a Ray cluster (ray_cluster) for status and
Ray's log API. `cluster up`, then status and logs on the cluster it brought up, a node's Ray dying, and `cluster
down` (site.yml / teardown.yml, process runtime, through ansible-runner): tests/test_ansible.py.

Every command runs inside the bed's head host (the bridge has no address in the machine's own
namespace), the way an operator on a node would run it; the JSON outputs are what the tests read.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import List, Optional

import pytest
import yaml
from kit_testbed.ansible_runs import cluster_cli

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
ANSIBLE_DIR = REPO / "ansible"
PREFLIGHT_LIMIT_S = 30  # issue 14: each preflight case within 30 s


@pytest.fixture(scope="module", autouse=True)
def _libraries():
    for name in ("ansible_runner", "fabric", "docker"):
        pytest.importorskip(name, reason="pip install -r requirements/dev.txt")


# ---- inventories -----------------------------------------------------------------------------------
def write_inventory(path: Path, heads: List[tuple], workers: List[tuple], file_vars: Optional[dict] = None, host_vars=None) -> Path:
    """A YAML inventory: ray_head/ray_workers under ray_cluster, `file_vars` as the group's vars."""

    def hosts(pairs):
        return {n: dict({"ansible_host": ip}, **((host_vars or (lambda n: {}))(n))) for n, ip in pairs} or None

    inv = {
        "ray_cluster": {
            "children": {"ray_head": {"hosts": hosts(heads)}, "ray_workers": {"hosts": hosts(workers)}},
            "vars": dict(file_vars or {}),
        }
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def ssh_vars(sb, extra: Optional[dict] = None) -> dict:
    """The ssh bed's access (root, its key, no host-key prompts) and the process runtime."""
    v = {
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(sb.key),
        "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectTimeout=10",
        "ansible_python_interpreter": str(VENV_PYTHON),
        "ray_runtime": "process",
        "alpa_kit_cluster_cidr": sb.testbed.subnet,
    }
    v.update(extra or {})
    return v


def bed_inventory(sb, name: str, extra_hosts=(), **extra) -> Path:
    ips = sb.testbed.ips
    return write_inventory(
        sb.testbed.state_dir / "cluster-ops" / name / "hosts.yml",
        [("head", ips["head"])],
        [(n, ips[n]) for n in ("w1", "w2")] + list(extra_hosts),
        ssh_vars(sb, extra),
    )


cli = cluster_cli  # the commands run inside a bed host (kit_testbed.ansible_runs)


def preflight(bed, inventory: Path, *extra, host: str = "head"):
    t0 = time.monotonic()
    p = cli(bed, "preflight", "-i", inventory, "--format", "json", *extra, host=host, timeout=90)
    seconds = time.monotonic() - t0
    try:
        result = json.loads(p.stdout)
    except ValueError:
        raise AssertionError("preflight printed no JSON (rc=%d):\n%s\n%s" % (p.returncode, p.stdout[-3000:], p.stderr[-3000:]))
    return p, result, seconds


def as_json(p: subprocess.CompletedProcess) -> dict:
    try:
        return json.loads(p.stdout)
    except ValueError:
        raise AssertionError("no JSON from %s (rc=%d):\n%s\n%s" % (p.args[3:6], p.returncode, p.stdout[-2000:], p.stderr[-2000:])) from None


def failed(result: dict, host: Optional[str] = None, name: Optional[str] = None) -> List[dict]:
    return [c for c in result["checks"] if not c["ok"] and (host is None or c["node"] == host) and (name is None or c["name"] == name)]


# ---- preflight over real SSH (ssh_bed: sshd in head, w1, w2; no Ray) --------------------------------
def test_preflight_is_green_on_clean_hosts(ssh_bed):
    p, result, seconds = preflight(ssh_bed.testbed, bed_inventory(ssh_bed, "clean"))
    assert p.returncode == 0, (p.stdout[-4000:], p.stderr[-2000:])
    assert result["ok"] and not failed(result)
    assert set(result["hosts"]) == {"head", "w1", "w2"}
    for name, h in result["hosts"].items():
        assert h["node_ip"] == ssh_bed.testbed.ips[name]  # the one interface in the CIDR is the inventory's address
        assert {h["cells"][c] for c in ("ssh", "iface", "ports", "clock")} == {"ok"}, h
        assert h["cells"]["engine"] == "-"  # process runtime: no Docker Engine asked for
    assert seconds < PREFLIGHT_LIMIT_S


def test_preflight_catches_a_port_already_in_use(ssh_bed):
    bed = ssh_bed.testbed
    port = 8076  # the plan's node_manager port (cluster.yaml): every node needs it
    squatter = bed.popen(
        "w1",
        str(VENV_PYTHON),
        "-c",
        # SO_REUSEADDR as servers bind: the connections of a Ray that just stopped on w1 may
        # still be in TIME_WAIT on the port, which only a plain bind minds
        "import os,socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
        "socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', %d)); s.listen(); "
        "print('listening', os.getpid(), flush=True); time.sleep(120)" % port,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        said = squatter.stdout.readline().split()
        assert said[:1] == ["listening"], said
        p, result, seconds = preflight(bed, bed_inventory(ssh_bed, "port"))
    finally:  # its PID in w1's own PID namespace (killing nsenter outside would leave it running)
        bed.exec("w1", "kill", said[1], check=False)
        squatter.wait(10)
    assert p.returncode == 3, p.stdout[-3000:]
    bad = failed(result)
    assert [(c["node"], c["name"]) for c in bad] == [("w1", "ports")], bad
    assert "8076 (node_manager) held by python" in bad[0]["detail"], bad[0]
    assert "alpa_kit_ports: {node_manager: OTHER_PORT}" in bad[0]["fix"]
    assert result["hosts"]["w1"]["cells"]["ports"] == "FAIL" and result["hosts"]["w2"]["cells"]["ports"] == "ok"
    assert "host w1" in p.stderr and "8076" in p.stderr  # the one stderr line names host and port
    assert seconds < PREFLIGHT_LIMIT_S


def test_preflight_catches_a_second_interface_in_the_cidr(ssh_bed):
    bed = ssh_bed.testbed
    extra = "10.77.0.99" if bed.subnet.startswith("10.77.0.") else None
    assert extra, bed.subnet
    # a second NIC (one end of a veth pair) with an address in the cluster CIDR, like a second network's card
    bed.exec(
        "w2", "sh", "-c", "ip link add aktfx0 type veth peer name aktfx1 && ip addr add %s/32 dev aktfx0 && ip link set aktfx0 up" % extra
    )
    try:
        p, result, seconds = preflight(bed, bed_inventory(ssh_bed, "iface"))
    finally:
        bed.exec("w2", "ip", "link", "del", "aktfx0", check=False)
    assert p.returncode == 3, p.stdout[-3000:]
    bad = failed(result)
    assert [(c["node"], c["name"]) for c in bad] == [("w2", "iface")], bad
    assert "aktfx0=%s" % extra in bad[0]["detail"] and "eth0=%s" % bed.ips["w2"] in bad[0]["detail"], bad[0]
    assert "narrow alpa_kit_cluster_cidr" in bad[0]["fix"]
    assert seconds < PREFLIGHT_LIMIT_S


def test_preflight_names_an_unreachable_host_and_does_not_hang(ssh_bed):
    bed = ssh_bed.testbed
    inventory = bed_inventory(ssh_bed, "unreachable", extra_hosts=[("w9", "10.77.0.9")])  # nobody owns .9
    p, result, seconds = preflight(bed, inventory, "--deadline", "20")
    assert p.returncode == 3, p.stdout[-3000:]
    bad = failed(result)
    assert [(c["node"], c["name"]) for c in bad] == [("w9", "ssh")], bad
    assert "cannot SSH to root@10.77.0.9:22" in bad[0]["detail"]
    assert "ansible_host" in bad[0]["fix"]
    assert all(result["hosts"][h]["cells"]["ssh"] == "ok" for h in ("head", "w1", "w2"))  # the others still checked
    assert "host w9" in p.stderr
    assert seconds < PREFLIGHT_LIMIT_S


# ---- preflight with Docker Engines (site_bed: dockerd per node, registry on the controller) -----------
def site_inventory(site, name: str, **extra) -> Path:
    etc = site.testbed.state_dir / "cluster-ops"
    v = {
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(site.ssh.key),
        "ansible_python_interpreter": "/usr/bin/python3",
        "ray_runtime": "docker",
        "ray_gpus": False,
        "alpa_kit_cluster_cidr": site.cluster_cidr,
        "alpa_kit_registry": site.registry,
    }
    v.update(extra)
    nodes = list(site.nodes.items())
    return write_inventory(
        etc / name / "hosts.yml", nodes[:1], nodes[1:], v, host_vars=lambda n: {"alpa_kit_docker_host": site.docker_sockets[n]}
    )


def test_preflight_docker_engine_and_image_present_or_pullable(site_bed):
    p, result, seconds = preflight(site_bed.testbed, site_inventory(site_bed, "docker-ok"), host=site_bed.controller)
    assert p.returncode == 0, (p.stdout[-4000:], p.stderr[-2000:])
    assert result["image"] == site_bed.image
    for name in site_bed.nodes:
        assert result["hosts"][name]["cells"]["engine"] == "ok" and result["hosts"][name]["cells"]["image"] == "ok"
    engine = [c for c in result["checks"] if c["name"] == "engine"]
    assert all(c["detail"].startswith("Docker Engine ") for c in engine), engine
    image = [c["detail"] for c in result["checks"] if c["name"] == "image"]
    assert all(site_bed.image in d and ("present" in d or "pullable" in d) for d in image), image
    assert seconds < PREFLIGHT_LIMIT_S


def test_preflight_catches_a_missing_image(site_bed):
    missing = "%s/alpa-cluster-kit/jax:no-such-tag-%s" % (site_bed.registry, uuid.uuid4().hex[:6])
    inventory = site_inventory(site_bed, "docker-missing", alpa_kit_image=missing)
    p, result, seconds = preflight(site_bed.testbed, inventory, host=site_bed.controller)
    assert p.returncode == 3, p.stdout[-3000:]
    bad = failed(result)
    assert sorted(c["node"] for c in bad) == sorted(site_bed.nodes) and {c["name"] for c in bad} == {"image"}, bad
    assert all(missing in c["detail"] and "nor pullable" in c["detail"] for c in bad), bad
    assert "docker push %s" % missing in bad[0]["fix"]
    assert seconds < PREFLIGHT_LIMIT_S


# ---- status and logs on a running Ray (ray_cluster: head + 2 workers, no sshd) ------------------------
def ray_inventory(rc, name: str, heads, workers, **extra) -> Path:
    v = {"ray_runtime": "process", "alpa_kit_cluster_cidr": rc.testbed.subnet}
    v.update(extra)
    return write_inventory(rc.testbed.state_dir / "cluster-ops" / name / "hosts.yml", heads, workers, v)


def status(bed, inventory: Path, host: str = "head"):
    p = cli(bed, "status", "-i", inventory, "--format", "json", host=host, timeout=60)
    try:
        return p, json.loads(p.stdout)
    except ValueError:
        raise AssertionError("status printed no JSON (rc=%d):\n%s\n%s" % (p.returncode, p.stdout[-2000:], p.stderr))


def test_status_of_a_running_cluster_matches_its_inventory(ray_cluster):
    ips = ray_cluster.node_ips
    inventory = ray_inventory(ray_cluster, "good", [("head", ips["head"])], [("w1", ips["w1"]), ("w2", ips["w2"])])
    p, result = status(ray_cluster.testbed, inventory)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-2000:])
    assert result["ok"] and result["problems"] == []
    assert result["jobs_api"] == "http://%s:%d" % (ips["head"], ray_cluster.spec.ports["dashboard"])
    assert result["auth"] in ("disabled", "token")
    import ray

    assert result["ray_version"] == ray.__version__
    alive = {n["ip"]: n for n in result["nodes"] if n["alive"]}
    assert set(alive) == set(ips.values())
    assert [n["host"] for n in alive.values() if n["head"]] == ["head"]
    assert all(n["resources"]["CPU"] == 2 for n in alive.values())  # the fixture's --num-cpus
    # the table says the same for people
    table = cli(ray_cluster.testbed, "status", "-i", inventory)
    assert table.returncode == 0 and "3 alive node(s)" in table.stdout and "(head)" in table.stdout


def test_status_exits_3_when_the_cluster_is_not_the_inventory(ray_cluster):
    ips = ray_cluster.node_ips
    bed = ray_cluster.testbed
    cases = {
        # w1 named as the head: it serves no dashboard, Ray's head is found among the inventory's workers
        "swapped": (
            [("w1", ips["w1"])],
            [("head", ips["head"]), ("w2", ips["w2"])],
            "the inventory's head w1 (%s) serves no Ray dashboard; Ray's head answers at http://%s:" % (ips["w1"], ips["head"]),
        ),
        # w2 left out: an alive node the inventory lacks
        "missing": ([("head", ips["head"])], [("w1", ips["w1"])], "is alive but not in the inventory"),
        # a node the inventory promises and Ray does not have
        "extra": ([("head", ips["head"])], [("w1", ips["w1"]), ("w2", ips["w2"]), ("w9", "10.77.0.9")], "has no Ray node"),
    }
    for name, (heads, workers, says) in cases.items():
        p, result = status(bed, ray_inventory(ray_cluster, "bad-" + name, heads, workers))
        assert p.returncode == 3, (name, p.stdout[-2000:], p.stderr)
        assert any(says in x["problem"] for x in result["problems"]), (name, result["problems"])
        assert p.stderr.startswith("cluster status: %d difference(s)" % len(result["problems"]))
        assert result["problems"][0]["problem"] in p.stderr  # the first one, with its fix, on one stderr line


_JOB = r"""
import ray, sys
ray.init(address="auto", log_to_driver=False)
marker = sys.argv[1]

@ray.remote(num_cpus=0)
def say():
    print(marker, ray.util.get_node_ip_address(), flush=True)
    return ray.util.get_node_ip_address()

ips = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
print("IPS", ray.get([say.options(resources={"node:" + ip: 0.001}).remote() for ip in ips]))
print("JOB", ray.get_runtime_context().get_job_id())
if len(sys.argv) > 2:  # what a failed training job does: its logs, from every node, next to its report
    from alpa_job.cluster.control.logs import collect_job_logs
    print("COLLECTED", collect_job_logs(sys.argv[2]))
"""


def test_logs_through_rays_log_api(ray_cluster, tmp_path):
    bed = ray_cluster.testbed
    marker = "akt-marker-%s" % uuid.uuid4().hex[:8]
    job_dir = tmp_path / "job-run"
    run = ray_cluster.run_python(_JOB, marker, job_dir, timeout=180)
    job_id = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("JOB ")][0]
    # the job's side (alpa_job.cluster.control.logs.collect_job_logs): Ray's log API from inside the connected driver
    assert "COLLECTED %s" % (job_dir / "logs") in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert sorted(p.name for p in (job_dir / "logs").iterdir()) == sorted(ray_cluster.node_ips.values())
    assert (job_dir / "logs" / ray_cluster.head_ip / "raylet.out").stat().st_size > 0
    ips = ray_cluster.node_ips
    inventory = ray_inventory(ray_cluster, "logs", [("head", ips["head"])], [("w1", ips["w1"]), ("w2", ips["w2"])])
    out = tmp_path / "logs"
    p = cli(bed, "logs", "-i", inventory, "--job", job_id, "--out", out, timeout=240)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-2000:])
    collection = json.loads((out / "collection.json").read_text())
    assert {h["host"]: h["how"] for h in collection["hosts"]} == {"head": "api", "w1": "api", "w2": "api"}
    assert collection["job_id"] == job_id
    assert (out / "head" / "gcs_server.out").exists()
    for host in ("head", "w1", "w2"):
        # byte for byte what the node wrote: every file of this job in the node's log dir, and the job's
        # output (the marker its tasks printed) wherever Ray put it on that node
        # (session_latest is a link to the host's own /tmp/ray/...: from out here, the newest session dir)
        disk = max(ray_cluster.logs(host).glob("session_2*"), key=lambda d: d.stat().st_mtime) / "logs"
        mine = ("worker-*-%s-*.out" % job_id, "worker-*-ffffffff-*.out")  # ffffffff: see JobRef.keeps
        on_disk = {w.name: w.read_bytes() for pattern in mine for w in disk.glob(pattern)}
        got = {w.name: w.read_bytes() for pattern in mine for w in (out / host).glob(pattern)}
        assert set(got) == set(on_disk) and got, (host, sorted(got), sorted(on_disk))
        assert all(got[n] == on_disk[n][: len(got[n])] for n in got)  # (a file may have grown since)
        printed = [f.relative_to(disk) for f in disk.rglob("*") if f.is_file() and marker.encode() in f.read_bytes()]
        assert printed, (host, "the job's tasks printed nothing on this node?")
        assert all(marker in (out / host / f).read_text(errors="replace") for f in printed), (host, printed)
        assert (out / host / "raylet.out").stat().st_size > 0
        # other jobs' worker logs are left out
        assert not [w for w in (out / host).glob("worker-*.out") if w.name not in got]


def test_logs_and_status_on_the_head_need_no_inventory(ray_cluster, tmp_path):
    """With Ray up, `cluster logs|status --address HEAD:GCS` on the head, and no inventory at the default path:
    Ray's node list names the hosts. With nothing answering there: one line naming --inventory, exit 2, fast."""
    from alpa_job.cluster.control.inventory import DEFAULT_INVENTORY

    if Path(DEFAULT_INVENTORY).exists():
        pytest.skip("this checkout has an inventory at %s: the commands would read it" % DEFAULT_INVENTORY)
    bed, ips = ray_cluster.testbed, ray_cluster.node_ips
    env = {"ALPA_KIT_CLUSTER_SPEC": str(ray_cluster.spec_path)}  # the bed's ports
    out = tmp_path / "logs"
    p = cli(bed, "logs", "--address", ray_cluster.address, "--out", out, timeout=240, env=env)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-2000:])
    collection = json.loads((out / "collection.json").read_text())
    assert {h["host"]: h["how"] for h in collection["hosts"]} == {ip: "api" for ip in ips.values()}
    for ip in ips.values():
        assert ip in p.stdout and (out / ip / "raylet.out").stat().st_size > 0
    assert (out / ray_cluster.head_ip / "gcs_server.out").exists()

    p = cli(bed, "status", "--address", ray_cluster.address, "--format", "json", env=env, timeout=60)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-2000:])
    result = json.loads(p.stdout)
    assert result["compared"] is False and result["inventory"] is None and result["problems"] == []
    alive = {n["ip"]: n for n in result["nodes"] if n["alive"]}
    assert set(alive) == set(ips.values()) and [ip for ip, n in alive.items() if n["head"]] == [ray_cluster.head_ip]
    table = cli(bed, "status", "--address", ray_cluster.address, env=env, timeout=60)
    assert table.returncode == 0 and "not compared against an inventory" in table.stdout
    assert all(ip in table.stdout for ip in ips.values()) and "3 alive node(s)" in table.stdout

    # Ray down there (w1 runs no head): the inventory is asked for, in one line, within the request timeout
    for action in ("logs", "status"):
        t0 = time.monotonic()
        p = cli(
            bed,
            action,
            "--address",
            ips["w1"],
            "--out" if action == "logs" else "--format",
            tmp_path / "none" if action == "logs" else "json",
            env=env,
            timeout=60,
        )
        seconds = time.monotonic() - t0
        assert p.returncode == 2, (action, p.stdout, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "did not answer within" in lines[0] and "pass --inventory FILE" in lines[0], lines
        assert seconds < 30, (action, seconds)
    assert not (tmp_path / "none").exists()
