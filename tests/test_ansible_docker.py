"""Day one at a user's site (issue 11): `python -m alpa_job cluster up` (site.yml) with the example inventory's
defaults (ray_runtime: docker, ray_stack: jax, a registry) run from a controller OUTSIDE the cluster
(``ctl`` on its own admin subnet) against 3 test-bed nodes, each with a real dockerd that pulls the
kit's CPU image from the registry on the controller (fixture ``site_bed``, tests/fixtures_testbed.py).

Order is the file's order: the bad inputs first (each must stop before any change on any node), then
the cluster up (doctor green), a token-authenticated `ray job submit` from the controller training
across the 3 nodes, the re-run from the controller over fresh SSH connections (changed=0: the
firewall admitted it), a wrong admin CIDR against the running cluster (stops, changes nothing), and
teardown (containers, our nft table and its include gone; the image, other tables and the plan stay).
What only the test bed needs is set on top of the example inventory and said so: CPU nodes
(ray_gpus: false), a plain-HTTP registry, per-node paths (the hosts share one filesystem), each
node's dockerd socket, and limits within this sandbox's hard limits.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import uuid

import pytest
import yaml

from kit_testbed.ansible_runs import CONTAINER, SiteAnsible, failure_lines, played

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

SENTINEL_TABLE = "akt_not_ours"  # a table of someone else's: teardown must leave it


@pytest.fixture(scope="module")
def site(site_bed):
    pytest.importorskip("ansible")
    s = SiteAnsible(site_bed)
    for node in site_bed.nodes:  # someone else's table, which nothing of ours may touch
        s.bed.exec(node, "nft", "add", "table", "inet", SENTINEL_TABLE)
    yield s

    def restore(node):  # leave the session's site as it was
        site_bed.docker(node, "rm", "-f", CONTAINER, check=False)
        site_bed.docker(node, "rmi", "-f", site_bed.image, check=False)
        s.bed.exec(node, "nft", "delete", "table", "inet", "alpa_kit", check=False)
        s.bed.exec(node, "nft", "delete", "table", "inet", SENTINEL_TABLE, check=False)

    with concurrent.futures.ThreadPoolExecutor(len(site_bed.nodes)) as pool:  # each node its own dockerd
        list(pool.map(restore, site_bed.nodes))


_STATE = {}


def _site_up(site):
    if "up" not in _STATE:
        _STATE["up"] = site.run("site.yml", site.inventory("good"))
    return _STATE["up"]


def _bad(site, mistake):
    ctl, reg = site.site.controller_ip, site.site.registry
    host, port = reg.rsplit(":", 1)
    if mistake == "wrong_admin_cidr":
        return (
            {"alpa_kit_admin_cidrs": ["192.0.2.0/24"]},
            None,
            r"the controller reaches this node from %s, which neither alpa_kit_admin_cidrs \(192\.0\.2\.0/24\) "
            r"nor the cluster's members hold: its firewall would lock you out\. Add %s/32 to "
            r"alpa_kit_admin_cidrs" % (re.escape(ctl), re.escape(ctl)),
        )
    if mistake == "registry_unreachable":  # nothing listens there
        return (
            {"alpa_kit_registry": "%s:%d" % (host, int(port) + 1)},
            None,
            r"registry %s:%d is unreachable \(.*\); start it or fix alpa_kit_registry" % (re.escape(host), int(port) + 1),
        )
    if mistake == "tag_missing":
        return (
            {"alpa_kit_images": {"jax_cpu": "alpa-cluster-kit/jax:no-such-tag"}},
            None,
            r"registry %s has no alpa-cluster-kit/jax:no-such-tag; push it" % re.escape(reg),
        )
    if mistake == "no_docker_engine":  # one node's engine is missing: every node stops
        return (
            {},
            {"w2": {"alpa_kit_docker_host": "unix:///run/%s-nothing-here.sock" % site.bed.prefix}},
            r"w2: ray_runtime is docker but no Docker Engine answers at unix:///run/\S+-nothing-here\.sock",
        )
    if mistake == "no_address_in_cidr":  # holds the head only
        head_ip = list(site.site.nodes.values())[0]
        return (
            {"alpa_kit_cluster_cidr": head_ip + "/32"},
            None,
            r"host w1: no interface of this host has an address in cluster CIDR %s/32" % re.escape(head_ip),
        )
    if mistake == "two_heads":
        return ({}, None, r"group ray_head must hold exactly one host.*it holds 2: head, w1")
    raise AssertionError(mistake)


def _bad_inventory(site, mistake):
    overrides, per_host, message = _bad(site, mistake)
    path = site.inventory(mistake, overrides, heads=["head", "w1"] if mistake == "two_heads" else None)
    if per_host:
        inv = yaml.safe_load(path.read_text())
        for group in inv["ray_cluster"]["children"].values():
            for name, hv in group["hosts"].items():
                hv.update(per_host.get(name, {}))
        path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path, message


def _assert_nothing_changed(site, summary, before):
    counts, text = summary["hosts"], played(summary)
    assert all(c["changed"] == 0 for c in counts.values()), (counts, text[-4000:])
    assert "TASK [ray_firewall" not in text and "TASK [ray_cluster" not in text
    assert site.containers() == before["containers"]
    assert site.images() == before["images"]
    assert site.tables() == before["tables"]
    assert site.files() == before["files"]


def _snapshot(site):
    return {"containers": site.containers(), "images": site.images(), "tables": site.tables(), "files": site.files()}


@pytest.mark.parametrize(
    "mistake", ["wrong_admin_cidr", "registry_unreachable", "tag_missing", "no_docker_engine", "no_address_in_cidr", "two_heads"]
)
def test_bad_input_stops_before_any_change(site, mistake):
    assert "up" not in _STATE  # the nodes are still untouched
    before = _snapshot(site)
    assert not any(before["containers"].values()) and all(SENTINEL_TABLE in t for t in before["tables"].values())
    inventory, message = _bad_inventory(site, mistake)
    p, summary = site.run("site.yml", inventory, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert re.search(message, failure_lines(summary)), summary["failures"]
    _assert_nothing_changed(site, summary, before)
    assert summary["seconds"] < 90, summary["seconds"]


def _auth_state(site) -> str:
    """What a failed run needs for diagnosis: each container's auth env (hashed) and the token file's."""
    import hashlib

    def h(text):
        return hashlib.sha256(text.strip().encode()).hexdigest()[:8]

    lines = ["token file %s: %s" % (site.token_file, h(site.token_file.read_text()) if site.token_file.exists() else "absent")]
    for node in site.site.nodes:
        p = site.site.docker(node, "inspect", "--format", "{{json .Config.Env}}", CONTAINER, check=False)
        env = json.loads(p.stdout) if p.returncode == 0 else []
        lines.append(
            "%s: %s"
            % (
                node,
                {
                    e.split("=", 1)[0]: h(e.split("=", 1)[1]) if "TOKEN" in e else e.split("=", 1)[1]
                    for e in env
                    if e.startswith("RAY_AUTH")
                },
            )
        )
    return "\n".join(lines)


def test_site_from_an_outside_controller_brings_the_cluster_up(site):
    if "up" not in _STATE:  # every node's dockerd pulls the image from the controller's registry: none has it yet
        assert not [node for node, images in site.images().items() if site.site.image in images], site.images()
    p, summary = _site_up(site)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-8000:] + "\n" + _auth_state(site)
    counts = summary["hosts"]
    assert set(counts) == {"localhost", "head", "w1", "w2"}
    assert all(c["failed"] == 0 and c["unreachable"] == 0 for c in counts.values()), counts
    nodes = site.site.nodes
    head_ip = nodes["head"]
    text = played(summary)
    assert re.search(r"doctor: %s:6379 .*: OK" % re.escape(head_ip), text), text[-4000:]
    assert "3 alive node(s): %s" % ", ".join(nodes.values()) in text
    ctl = site.site.controller_ip
    for node, ip in nodes.items():
        # the image came from the registry (no node had it before the run)
        assert site.site.image in site.images()[node]
        info = json.loads(site.site.docker(node, "inspect", CONTAINER).stdout)[0]
        assert info["State"]["Running"] and info["Config"]["Image"] == site.site.image
        assert info["HostConfig"]["NetworkMode"] == "host" and info["Config"]["User"] == "1000:1000"
        # the token is a file only Ray's user reads; `docker inspect` shows its path, never its value
        token = site.token_file.read_text().strip()
        env = dict(e.split("=", 1) for e in info["Config"]["Env"])
        assert token not in json.dumps(info) and "RAY_AUTH_TOKEN" not in env, env.keys()
        token_path = site.etc(node) / "alpa-kit" / "ray_auth_token"
        assert env["RAY_AUTH_TOKEN_PATH"] == str(token_path) and token_path.read_text().strip() == token
        st = token_path.stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (1000, 0o400)
        # the container's user owns the directory it writes (Ray's /tmp/ray), and Ray wrote there
        st = site.ray_dir(node).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1000, 1000, 0o777)  # 0777: what Ray sets itself
        assert any(site.ray_dir(node).glob("session_*")), list(site.ray_dir(node).iterdir())
        # the firewall admits the controller's own address (as the node sees it) to the admin ports
        table = site.our_table(node)
        assert "elements = { %s }" % ctl in table, table
        # ... and survives a reboot: the distribution's nftables config includes the rendered file
        conf = (site.etc(node) / "nftables.conf").read_text()
        assert 'include "%s"' % (site.etc(node) / "alpa-kit" / "nftables-alpa_kit.nft") in conf
        check = site.bed.exec(node, "nft", "-c", "-f", str(site.etc(node) / "nftables.conf"), check=False)
        assert check.returncode == 0, check.stderr
    print("site.yml docker runtime, cold incl. image pull (3 nodes, outside controller): %.1f s" % summary["seconds"])


def test_a_job_from_the_controller_trains_across_the_nodes_with_token_auth(site):
    assert _site_up(site)[0].returncode == 0
    nodes = site.site.nodes
    head_ip = nodes["head"]
    run_id = "akt-job-%s" % uuid.uuid4().hex[:8]
    spec = site.etc("head") / "alpa-kit" / "cluster.yaml"  # mounted at the same path in the containers
    submit = [
        "ray",
        "job",
        "submit",
        "--address",
        "http://%s:8265" % head_ip,
        "--submission-id",
        run_id,
        "--",
        "python",
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
        "/tmp/ray/" + run_id,
    ]
    # Token auth is on: without the token the jobs API refuses the controller.
    anon = site.site.on_controller(
        "ray", "job", "list", "--address", "http://%s:8265" % head_ip, env={"RAY_AUTH_MODE": "disabled"}, timeout=120, check=False
    )
    assert anon.returncode != 0, anon.stdout[-2000:]
    token = site.token_file.read_text().strip()
    job = site.site.on_controller(*submit, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}, timeout=500, check=False)
    assert job.returncode == 0, job.stdout[-5000:] + job.stderr[-3000:]
    report = json.loads((site.ray_dir("head") / run_id / "report.json").read_text())
    assert report["steps"] == 3
    assert report["summary"]["hosts"] == 3 and report["summary"]["processes"] == 3
    assert sorted(x["ip"] for x in report["processes"]) == sorted(nodes.values())


def test_second_run_from_the_controller_is_admitted_and_changes_nothing(site):
    assert _site_up(site)[0].returncode == 0
    ids = site.containers()
    p, summary = site.run("site.yml", site.inventory("good"), fresh_ssh=True)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    counts = summary["hosts"]
    assert {h: c["changed"] for h, c in counts.items()} == {"localhost": 0, "head": 0, "w1": 0, "w2": 0}, played(summary)[-8000:]
    assert site.containers() == ids  # nothing restarted
    for node in site.site.nodes:  # a brand-new SSH connection from the controller passes the firewall
        assert site.site.ssh.ssh(node, "hostname", timeout=60).stdout.strip() == node
    print("site.yml docker runtime, idempotent re-run (fresh SSH): %.1f s" % summary["seconds"])


def test_wrong_admin_cidr_against_the_running_cluster_changes_nothing(site):
    assert _site_up(site)[0].returncode == 0
    before = _snapshot(site)
    tables = {n: site.our_table(n) for n in site.site.nodes}
    inventory, message = _bad_inventory(site, "wrong_admin_cidr")
    p, summary = site.run("site.yml", inventory, fresh_ssh=True, timeout=240)
    assert p.returncode != 0 and re.search(message, failure_lines(summary)), (p.stdout + p.stderr)[-5000:]
    _assert_nothing_changed(site, summary, before)
    assert {n: site.our_table(n) for n in site.site.nodes} == tables


def test_teardown_removes_the_containers_and_the_table_and_nothing_else(site):
    assert _site_up(site)[0].returncode == 0
    before = _snapshot(site)
    p, _ = site.run("teardown.yml", site.inventory("good"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    assert site.containers() == {n: "" for n in site.site.nodes}
    assert site.images() == before["images"]  # the image stays (a re-run needs no pull)
    for node, tables in site.tables().items():
        assert "alpa_kit" not in tables and SENTINEL_TABLE in tables, (node, tables)
        assert tables == before["tables"][node].replace("table inet alpa_kit\n", "")
        assert "alpa_kit" not in (site.etc(node) / "nftables.conf").read_text()
    gone = {"alpa-kit/nftables-alpa_kit.nft", "alpa-kit/ray_auth_token"}  # the token leaves with the cluster
    assert site.files() == {n: [f for f in fs if f not in gone] for n, fs in before["files"].items()}
    p2, summary2 = site.run("teardown.yml", site.inventory("good"))
    assert p2.returncode == 0 and summary2["hosts"], (p2.stdout + p2.stderr)[-4000:]
    assert all(c["changed"] == 0 for c in summary2["hosts"].values()), played(summary2)[-4000:]


def test_air_gapped_nodes_load_the_image_from_a_tar(site, tmp_path):
    """alpa_kit_image_source: load: the preflight finds the image missing and the archive on the
    controller, the node gets the tar copied and `docker_image_load`ed, the copy is removed; a second
    run finds the image and does nothing. A small image (the Debian base) stands in for the kit's."""
    from kit_testbed.site_layer import IMAGE_CACHE

    base = IMAGE_CACHE / "debian-bookworm-minbase.tar"
    if not base.exists():
        pytest.skip("no cached Debian base rootfs (%s) to make a small image from" % base)
    ref, archive = "akt-airgap/base:1", site.work / "airgap.tar"
    node, docker = "w2", site.site.docker
    docker(node, "import", str(base), ref, timeout=300)
    docker(node, "save", "-o", str(archive), ref, timeout=300)
    docker(node, "rmi", ref)
    play = site.work / "airgap.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Air-gapped image.",
                    "hosts": node,
                    "gather_facts": False,
                    "vars": {
                        "alpa_kit_image": ref,
                        "alpa_kit_image_source": "load",
                        "alpa_kit_image_archive": str(archive),
                        "ray_cluster_archive_dir": str(site.bed.host_dir(node)),
                    },
                    "tasks": [
                        {"name": "Preflight.", "ansible.builtin.include_role": {"name": "ray_node_prep", "tasks_from": "docker.yml"}},
                        {"name": "Image.", "ansible.builtin.include_role": {"name": "ray_cluster", "tasks_from": "image.yml"}},
                    ],
                }
            ],
            sort_keys=False,
        )
    )
    try:
        p, summary = site.run(str(play), site.inventory("good"))
        assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
        assert summary["hosts"][node]["changed"] == 3, played(summary)[-5000:]  # copied, loaded, copy removed
        assert ref in site.images()[node]
        assert not (site.bed.host_dir(node) / "airgap.tar").exists()
        p2, summary2 = site.run(str(play), site.inventory("good"))
        assert p2.returncode == 0 and summary2["hosts"][node]["changed"] == 0, played(summary2)[-4000:]
        # no archive where the operator said: one line, before anything is copied
        archive.unlink()
        docker(node, "rmi", ref)
        p3, summary3 = site.run(str(play), site.inventory("good"))
        assert p3.returncode != 0 and summary3["hosts"][node]["changed"] == 0
        assert re.search(
            r"w2: alpa_kit_image_source is load but the archive '%s' is not on the controller" % re.escape(str(archive)),
            failure_lines(summary3),
        ), summary3["failures"]
    finally:
        docker(node, "rmi", "-f", ref, check=False)
        archive.unlink(missing_ok=True)
