"""`python -m alpa_job cluster up|down` (site.yml / teardown.yml through ansible-runner) over real SSH
against 3 test-bed hosts (ray_runtime: process); the checks read the run's summary.json, not the RECAP.

The controller runs inside the head host (the bridge has no IP in the root namespace), managing the
head through SSH to its own IP like every other node. Order matters and is the file's order: the bad
inventories first (nothing may be started by them), then the cluster up, doctor green, a job, the
idempotent re-run, --check, and teardown.
"""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
ACTIONS = {"site.yml": "up", "teardown.yml": "down"}


def played(summary: dict) -> str:
    """Ansible's own (uncoloured) output of the run, from ansible-runner's artifacts."""
    return Path(summary["artifact_dir"], "stdout").read_text(errors="replace")


def failure_lines(summary: dict) -> str:
    return "\n".join("%s: %s%s" % (f["host"], "UNREACHABLE: " if f.get("unreachable") else "", f["message"])
                     for f in summary["failures"])


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
            "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                                       "-o ConnectTimeout=3",
            "ansible_python_interpreter": str(VENV_PYTHON),
            "ray_runtime": "process",
            "ray_cluster_python": str(VENV_PYTHON),
            "ray_cluster_python_manage": False,
            "ray_cluster_num_cpus": 2,
            "ray_cluster_object_store_memory": 200_000_000,
            "ray_cluster_env_extra": {"PYTHONPATH": str(REPO)},
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
        p = self.bed.exec("head", str(VENV_PYTHON), "-m", "alpa_job", "cluster", ACTIONS[playbook], "-i",
                          str(inventory), "--run-dir", str(run_dir), "--timeout", str(int(timeout) - 10), *extra,
                          cwd=str(REPO), timeout=timeout, check=False,
                          # own ControlPersist sockets: the default ~/.ansible/cp names a socket by
                          # host+port+user only, so another test bed's 10.77.0.2 would answer ours
                          env={"ANSIBLE_HOME": str(self.work / "home"), "ANSIBLE_FORCE_COLOR": "0",
                               "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.work / "home" / "cp"),
                               "ANSIBLE_NOCOLOR": "1"})
        summary_file = run_dir / "summary.json"
        assert summary_file.exists(), (p.stdout + p.stderr)[-4000:]
        return p, json.loads(summary_file.read_text())

    def ray_processes(self) -> dict:
        out = {}
        for h in self.bed.hosts:
            p = self.bed.exec(h.name, "pgrep", "-a", "-x", "raylet|gcs_server", check=False)
            out[h.name] = p.stdout.strip()
        return out

    def nft_tables(self) -> dict:
        return {h.name: self.bed.exec(h.name, "nft", "list", "tables").stdout for h in self.bed.hosts}


@pytest.fixture(scope="module")
def ansible(ssh_bed):
    pytest.importorskip("ansible")
    return Ansible(ssh_bed)


_STATE = {}


def _site(ansible):
    if "site" not in _STATE:
        _STATE["site"] = ansible.run("site.yml", ansible.good_inventory())
    return _STATE["site"]


def _bad(ansible, name):
    ips = ansible.bed.ips
    workers = [(n, ips[n]) for n in ("w1", "w2")]
    if name == "no_head":
        return ansible.inventory(name, [], workers), r"group ray_head must hold exactly one host.*it holds 0"
    if name == "two_heads":
        return (ansible.inventory(name, [("head", ips["head"]), ("w1", ips["w1"])], [("w2", ips["w2"])]),
                r"group ray_head must hold exactly one host.*it holds 2: head, w1")
    if name == "no_address_in_cidr":  # the CIDR typed in the inventory file holds the head (10.77.0.1) only
        return (ansible.inventory(name, [("head", ips["head"])], workers,
                                  file_vars={"alpa_kit_cluster_cidr": "10.77.0.0/31"}),
                r"host w1: no interface of this host has an address in cluster CIDR 10\.77\.0\.0/31 "
                r"\(found: .*eth0=10\.77\.0\.2")
    if name == "unreachable":  # nobody owns 10.77.0.9
        return (ansible.inventory(name, [("head", ips["head"])], workers + [("w9", "10.77.0.9")]),
                r"w9: UNREACHABLE: .*connect to host 10\.77\.0\.9 port 22")
    if name == "no_docker_engine":  # the docker runtime, and no engine answers on the nodes
        return (ansible.inventory(name, [("head", ips["head"])], workers, file_vars={
                    "ray_runtime": "docker", "ray_gpus": False,
                    "alpa_kit_docker_host": "unix:///run/%s-no-docker.sock" % ansible.bed.prefix}),
                r"head: ray_runtime is docker but no Docker Engine answers at unix:///run/\S+-no-docker\.sock "
                r"\(.*\); install Docker Engine")
    raise AssertionError(name)


@pytest.mark.parametrize("mistake", ["no_head", "two_heads", "no_address_in_cidr", "unreachable", "no_docker_engine"])
def test_inventory_mistakes_fail_early(ansible, mistake):
    inventory, message = _bad(ansible, mistake)
    p, summary = ansible.run("site.yml", inventory, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert re.search(message, failure_lines(summary)), summary["failures"]
    counts = summary["hosts"]
    assert all(c["changed"] == 0 for c in counts.values()), counts  # failed before touching anything
    text = played(summary)
    assert "TASK [ray_firewall" not in text and "TASK [ray_cluster" not in text  # stopped early
    assert not any(ansible.ray_processes().values())
    assert summary["seconds"] < 60, summary["seconds"]


def test_site_brings_the_cluster_up_and_the_doctor_is_green(ansible):
    p, summary = _site(ansible)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    counts = summary["hosts"]
    assert set(counts) == {"localhost", "head", "w1", "w2"}
    assert all(c["failed"] == 0 and c["unreachable"] == 0 for c in counts.values()), counts
    text = played(summary)
    assert re.search(r"doctor: 10\.77\.0\.1:6379 .*: OK", text), text[-4000:]
    assert "3 alive node(s): 10.77.0.1, 10.77.0.2, 10.77.0.3" in text
    procs = ansible.ray_processes()
    assert "gcs_server" in procs["head"] and all("raylet" in procs[h] for h in ("head", "w1", "w2")), procs
    for h in ansible.bed.hosts:  # the daemons outlived the tasks (no ssh -tt); our table is loaded ...
        assert "table inet alpa_kit" in ansible.nft_tables()[h.name]
        etc = ansible.bed.host_dir(h.name) / "etc"  # ... and included from the boot-time config
        assert 'include "%s"' % (etc / "alpa-kit" / "nftables-alpa_kit.nft") in (etc / "nftables.conf").read_text()
        # the token: a 0400 file on the node; neither the start record nor the daemons' env holds its value
        token = ansible.token_file.read_text().strip()
        placed = etc / "alpa-kit" / "ray_auth_token"
        assert placed.read_text().strip() == token and placed.stat().st_mode & 0o7777 == 0o400
        record = json.loads((etc / "alpa-kit" / "ray-start.json").read_text())
        assert token not in json.dumps(record) and record["env"]["RAY_AUTH_TOKEN_PATH"] == str(placed)
    print("site.yml (cold, 3 hosts): %.1f s" % summary["seconds"])


def test_a_job_runs_on_the_cluster(ansible):
    p, _ = _site(ansible)
    assert p.returncode == 0
    bed = ansible.bed
    spec = bed.host_dir("head") / "etc" / "alpa-kit" / "cluster.yaml"
    out = Path("/tmp") / ("akt-ansible-job-%s" % uuid.uuid4().hex[:8])
    token = ansible.token_file.read_text().strip()
    job = bed.exec("head", "ray", "job", "submit", "--address", "http://%s:8265" % bed.ips["head"], "--",
                   # the venv's python by path: a bare `python` in the job's shell found one without ray
                   str(VENV_PYTHON), "-m", "alpa_job", "train", "--model", "mlp", "--steps", "3", "--devices", "2",
                   "--batch-size", "96", "--cluster-spec", str(spec), "--out", str(out),
                   env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}, timeout=400, check=False)
    assert job.returncode == 0, job.stdout[-5000:] + job.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 3
    assert report["summary"]["hosts"] == 3 and report["summary"]["processes"] == 3
    assert sorted(x["ip"] for x in report["processes"]) == sorted(bed.ips.values())


def test_second_run_changes_nothing(ansible):
    assert _site(ansible)[0].returncode == 0
    p, summary = ansible.run("site.yml", ansible.good_inventory())
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    counts = summary["hosts"]
    assert set(counts) == {"localhost", "head", "w1", "w2"}
    assert {h: c["changed"] for h, c in counts.items()} == {"localhost": 0, "head": 0, "w1": 0, "w2": 0}, \
        played(summary)[-8000:]
    print("site.yml (idempotent re-run): %.1f s" % summary["seconds"])


def test_check_mode_on_a_running_cluster_changes_nothing(ansible):
    assert _site(ansible)[0].returncode == 0
    before = ansible.ray_processes()
    p, summary = ansible.run("site.yml", ansible.good_inventory(), "--check")
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    assert summary["check"] and summary["hosts"], summary
    assert all(c["changed"] == 0 for c in summary["hosts"].values()), played(summary)[-6000:]
    assert ansible.ray_processes() == before  # same PIDs: nothing restarted


def test_teardown_leaves_the_hosts_clean(ansible):
    assert _site(ansible)[0].returncode == 0
    p, _ = ansible.run("teardown.yml", ansible.good_inventory())
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    assert ansible.ray_processes() == {"head": "", "w1": "", "w2": ""}
    for name in ansible.bed.ips:  # the token leaves with the cluster
        assert not (ansible.bed.host_dir(name) / "etc" / "alpa-kit" / "ray_auth_token").exists()
    for name, tables in ansible.nft_tables().items():
        assert "alpa_kit" not in tables, (name, tables)
        conf = ansible.bed.host_dir(name) / "etc" / "nftables.conf"
        assert "alpa_kit" not in conf.read_text()  # the boot-time include is gone too
    # a second teardown finds nothing to do
    p2, summary2 = ansible.run("teardown.yml", ansible.good_inventory())
    assert p2.returncode == 0 and summary2["hosts"], (p2.stdout + p2.stderr)[-4000:]
    assert all(c["changed"] == 0 for c in summary2["hosts"].values()), played(summary2)[-4000:]
