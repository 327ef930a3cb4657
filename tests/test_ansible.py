"""`python -m alpa_job cluster up|down` (site.yml / teardown.yml through ansible-runner) over real SSH
against 3 test-bed hosts (ray_runtime: process); the checks read the run's summary.json, not the RECAP.

The controller runs inside the head host (the bridge has no IP in the root namespace), managing the
head through SSH to its own IP like every other node. Order matters and is the file's order: the bad
inventories first (nothing may be started by them), then the cluster up, doctor green, a job, the
idempotent re-run, --check, `cluster status` and `cluster logs` (then again with one node's Ray dead), and
teardown (and the logs after it, over SSH).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import pytest
from kit_testbed.ansible_runs import VENV_PYTHON, Ansible, failure_lines, played

pytestmark = [pytest.mark.testbed, pytest.mark.slow]


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
        return (
            ansible.inventory(name, [("head", ips["head"]), ("w1", ips["w1"])], [("w2", ips["w2"])]),
            r"group ray_head must hold exactly one host.*it holds 2: head, w1",
        )
    if name == "no_address_in_cidr":  # the CIDR typed in the inventory file holds the head (10.77.0.1) only
        return (
            ansible.inventory(name, [("head", ips["head"])], workers, file_vars={"alpa_kit_cluster_cidr": "10.77.0.0/31"}),
            r"host w1: no interface of this host has an address in cluster CIDR 10\.77\.0\.0/31 "
            r"\(found: .*eth0=10\.77\.0\.2",
        )
    if name == "unreachable":  # nobody owns 10.77.0.9
        return (
            ansible.inventory(name, [("head", ips["head"])], workers + [("w9", "10.77.0.9")]),
            # ssh says it as "connect to host ADDR port 22" or, when its connection dies under load, as Ansible's
            # "Data could not be sent to remote host 'ADDR'": either way the host and its address are named.
            r"w9: UNREACHABLE: .*(connect to host 10\.77\.0\.9 port 22|remote host '10\.77\.0\.9')",
        )
    if name == "no_docker_engine":  # the docker runtime, and no engine answers on the nodes
        return (
            ansible.inventory(
                name,
                [("head", ips["head"])],
                workers,
                file_vars={
                    "ray_runtime": "docker",
                    "ray_gpus": False,
                    "alpa_kit_docker_host": "unix:///run/%s-no-docker.sock" % ansible.bed.prefix,
                },
            ),
            r"head: ray_runtime is docker but no Docker Engine answers at unix:///run/\S+-no-docker\.sock "
            r"\(.*\); install Docker Engine",
        )
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
    assert summary["ok"] and summary["status"] == "successful" and summary["playbook"] == "site.yml"
    counts = summary["hosts"]
    assert set(counts) == {"localhost", "head", "w1", "w2"}
    assert all(c["failed"] == 0 and c["unreachable"] == 0 for c in counts.values()), counts
    assert counts["head"]["changed"] > 0 and summary["failures"] == []
    assert "site.yml on %s: OK" % ansible.good_inventory() in p.stdout  # `cluster up`'s end screen
    assert "doctor: " in (Path(summary["artifact_dir"]) / "stdout").read_text()  # Ansible's own output kept
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
    job = bed.exec(
        "head",
        "ray",
        "job",
        "submit",
        "--address",
        "http://%s:8265" % bed.ips["head"],
        "--",
        # the venv's python by path: a bare `python` in the job's shell found one without ray
        str(VENV_PYTHON),
        "-m",
        "alpa_job",
        "train",
        "--model",
        "mlp",
        "--steps",
        "3",
        "--devices",
        "2",
        "--batch-size",
        "96",
        "--cluster-spec",
        str(spec),
        "--out",
        str(out),
        env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
        timeout=400,
        check=False,
    )
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
    assert {h: c["changed"] for h, c in counts.items()} == {"localhost": 0, "head": 0, "w1": 0, "w2": 0}, played(summary)[-8000:]
    print("site.yml (idempotent re-run): %.1f s" % summary["seconds"])


def test_check_mode_on_a_running_cluster_changes_nothing(ansible):
    assert _site(ansible)[0].returncode == 0
    before = ansible.ray_processes()
    p, summary = ansible.run("site.yml", ansible.good_inventory(), "--check")
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    assert summary["check"] and summary["hosts"], summary
    assert all(c["changed"] == 0 for c in summary["hosts"].values()), played(summary)[-6000:]
    assert ansible.ray_processes() == before  # same PIDs: nothing restarted


def test_status_and_logs_then_a_node_whose_ray_died_is_named_and_its_logs_come_over_ssh(ansible, tmp_path):
    """`cluster status` and `cluster logs` on the cluster site.yml brought up: every node alive, the jax stack's
    token auth, each node's logs through Ray's log API. Then w2's Ray crashes (its raylet killed by PID):
    status exits 3 naming w2 once the GCS marks it dead, and w2's logs come over SSH instead. The teardown
    below then takes down the cluster as this leaves it."""
    assert _site(ansible)[0].returncode == 0
    bed, inventory = ansible.bed, ansible.good_inventory()
    p = ansible.cluster("status", "-i", inventory, "--format", "json")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr)
    status = json.loads(p.stdout)
    assert sorted(n["host"] for n in status["nodes"] if n["alive"]) == ["head", "w1", "w2"]
    assert status["auth"] == "token" and status["token_given"]
    p = ansible.cluster("logs", "-i", inventory, "--out", tmp_path / "up", timeout=240)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr)
    collection = json.loads((tmp_path / "up" / "collection.json").read_text())
    assert {h["host"]: h["how"] for h in collection["hosts"]} == {"head": "api", "w1": "api", "w2": "api"}
    assert (tmp_path / "up" / "w2" / "raylet.out").stat().st_size > 0

    raylets = bed.exec("w2", "pgrep", "-x", "raylet", check=False).stdout.split()
    assert len(raylets) == 1, raylets
    bed.exec("w2", "kill", "-9", raylets[0])
    deadline = time.monotonic() + 90
    while True:  # the GCS marks the node dead after its health checks fail
        p = ansible.cluster("status", "-i", inventory, "--format", "json")
        if p.returncode == 3:
            break
        assert time.monotonic() < deadline, "w2 still alive in Ray 90 s after its raylet was killed"
        time.sleep(2)
    assert any(x["node"] == "w2" for x in json.loads(p.stdout)["problems"])
    p = ansible.cluster("logs", "-i", inventory, "--out", tmp_path / "crash", timeout=240)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr)
    how = {h["host"]: h["how"] for h in json.loads((tmp_path / "crash" / "collection.json").read_text())["hosts"]}
    assert how == {"head": "api", "w1": "api", "w2": "ssh"}, how
    assert (tmp_path / "crash" / "w2" / "raylet.out").stat().st_size > 0


def test_teardown_leaves_the_hosts_clean(ansible, tmp_path):
    """`cluster down` on the cluster the test above left with one raylet dead; then the logs still come, every
    node's over SSH (no Ray answers), and a second teardown finds nothing to do."""
    assert _site(ansible)[0].returncode == 0
    p, summary = ansible.run("teardown.yml", ansible.good_inventory())
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    assert summary["playbook"] == "teardown.yml"
    assert ansible.ray_processes() == {"head": "", "w1": "", "w2": ""}
    for name in ansible.bed.ips:  # the token leaves with the cluster
        assert not (ansible.bed.host_dir(name) / "etc" / "alpa-kit" / "ray_auth_token").exists()
    for name, tables in ansible.nft_tables().items():
        assert "alpa_kit" not in tables, (name, tables)
        conf = ansible.bed.host_dir(name) / "etc" / "nftables.conf"
        assert "alpa_kit" not in conf.read_text()  # the boot-time include is gone too
    # Ray is gone everywhere: the logs come over SSH
    p = ansible.cluster("logs", "-i", ansible.good_inventory(), "--out", tmp_path / "down", timeout=240)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr)
    collection = json.loads((tmp_path / "down" / "collection.json").read_text())
    assert collection["api"] is None and "cannot reach Ray's dashboard" in collection["api_error"]
    assert {h["host"]: h["how"] for h in collection["hosts"]} == {"head": "ssh", "w1": "ssh", "w2": "ssh"}
    assert (tmp_path / "down" / "head" / "gcs_server.out").exists()
    # a second teardown finds nothing to do
    p2, summary2 = ansible.run("teardown.yml", ansible.good_inventory())
    assert p2.returncode == 0 and summary2["hosts"], (p2.stdout + p2.stderr)[-4000:]
    assert all(c["changed"] == 0 for c in summary2["hosts"].values()), played(summary2)[-4000:]
