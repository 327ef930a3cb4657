"""alpa_job.cluster.ray_api: the one GCS address, bounded join, alive-node reader and node pin.

Runs on the Alpa image's stack too (test_py39_stack runs the non-testbed tests under Ray 2.1.0), so the
real-Ray tests here read both Ray dialects' node rows from a real cluster.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from alpa_job.cluster import ray_api
from alpa_job.cluster.spec import load_spec
from alpa_job.errors import EXIT_TIMEOUT, KitError
from helpers_cli import silent_listener

REPO = str(Path(__file__).resolve().parent.parent)


# ---- the GCS address -----------------------------------------------------------------------------
def test_gcs_address_comes_from_the_spec(spec, tmp_path):
    assert ray_api.gcs_address(spec, "10.0.0.1") == "10.0.0.1:%d" % spec.ports["gcs"]
    path = tmp_path / "c.yaml"
    path.write_text("ports: {gcs: 6390}\n")
    assert ray_api.gcs_address(load_spec(str(path)), "10.0.0.1") == "10.0.0.1:6390"


@pytest.mark.parametrize(
    "given, want",
    [
        ("10.0.0.1:7000", "10.0.0.1:7000"),
        ("10.0.0.1", "10.0.0.1:6390"),  # a bare host: the spec's GCS port
        (" auto ", "auto"),
        ("local", "local"),
        ("ray://head:10001", "ray://head:10001"),
    ],
)
def test_normalize_address(tmp_path, given, want):
    path = tmp_path / "c.yaml"
    path.write_text("ports: {gcs: 6390}\n")
    assert ray_api.normalize_address(given, load_spec(str(path))) == want


def test_normalize_address_defaults_to_ray_address_then_default(monkeypatch, spec):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_api.normalize_address(None, spec) == "auto"
    assert ray_api.normalize_address("", spec, default="local") == "local"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    assert ray_api.normalize_address(None, spec) == "10.0.0.9:6379"


@pytest.mark.parametrize(
    "given, message",
    [
        ("http://10.0.0.1:8265", "is the dashboard/jobs URL; submit with `ray job submit --address http://10.0.0.1:8265"),
        ("10.0.0.1:gcs", "is not HOST:PORT"),
        ("10.0.0.1:70000", "is not HOST:PORT"),
    ],
)
def test_normalize_address_refuses_with_the_fix(spec, given, message):
    with pytest.raises(KitError, match=message.replace("?", r"\?").replace("(", r"\(")) as err:
        ray_api.normalize_address(given, spec)
    assert "\n" not in str(err.value)
    if given.startswith("http"):
        assert str(err.value).endswith("HOST:%d" % spec.ports["gcs"])


# ---- joining, bounded ------------------------------------------------------------------------------
JOIN = textwrap.dedent("""
    import sys
    from alpa_job.cluster.ray_api import join_ray
    from alpa_job.errors import KitError
    try:
        join_ray(sys.argv[1], timeout_s=float(sys.argv[2]), log_to_driver=False)
    except KitError as err:
        print("KITERROR", err.exit_code, err)
        sys.exit(err.exit_code)
    print("JOINED")
""")


def test_join_to_a_non_ray_port_fails_within_the_deadline_naming_it():
    server, held = silent_listener()
    address = "127.0.0.1:%d" % server.getsockname()[1]
    try:
        start = time.monotonic()
        p = subprocess.run([sys.executable, "-c", JOIN, address, "3"], cwd=REPO, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - start
    finally:
        server.close()
        for s in held:
            s.close()
    assert p.returncode == EXIT_TIMEOUT, p.stdout + p.stderr[-2000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("KITERROR")][0]
    assert address in line and "within 3 s" in line, line
    assert took < 3 + 15, took  # the deadline plus Python and `import ray`, not Ray's minutes of retries
    assert held, "the join never even reached the port"


def test_join_to_a_closed_port_fails_fast_naming_it():
    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        address = "127.0.0.1:%d" % s.getsockname()[1]
    with pytest.raises(KitError, match="cannot reach Ray GCS at %s" % address) as err:
        ray_api.join_ray(address, timeout_s=5)
    assert err.value.exit_code == EXIT_TIMEOUT


# ---- node rows: both dialects -------------------------------------------------------------------------
# What ray.nodes() returns on Ray 2.1.0 (no head marker) and on current Ray (the head's
# node:__internal_head__), trimmed to the fields the kit reads; the state API's row; a dashboard-style
# lower-case "alive".
ROW_RAY21 = {"NodeID": "a1", "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0, "node:10.0.0.1": 1.0}}
ROW_RAY2X_HEAD = {
    "NodeID": "b2",
    "Alive": True,
    "NodeManagerAddress": "10.0.0.2",
    "Resources": {"CPU": 4.0, "GPU": 2.0, "node:10.0.0.2": 1.0, "node:__internal_head__": 1.0},
}
ROW_DEAD = {"NodeID": "c3", "Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 4.0}}
ROW_LOWER = {"NodeID": "d4", "alive": True, "NodeManagerAddress": "10.0.0.4", "Resources": {"GPU": 8.0}}
ROW_STATE = {"node_id": "e5", "node_ip": "10.0.0.5", "state": "ALIVE", "is_head_node": False, "resources_total": {"CPU": 2.0}}
ROW_STATE_DEAD = {"node_id": "f6", "node_ip": "10.0.0.6", "state": "DEAD", "resources_total": {}}


def test_parse_node_reads_every_dialect():
    got = {n.ip: n for n in ray_api.parse_nodes([ROW_RAY21, ROW_RAY2X_HEAD, ROW_DEAD, ROW_LOWER, ROW_STATE, ROW_STATE_DEAD])}
    assert {ip: n.alive for ip, n in got.items()} == {
        "10.0.0.1": True,
        "10.0.0.2": True,
        "10.0.0.3": False,
        "10.0.0.4": True,
        "10.0.0.5": True,
        "10.0.0.6": False,
    }
    assert {ip: n.is_head for ip, n in got.items()} == {
        "10.0.0.1": None,
        "10.0.0.2": True,
        "10.0.0.3": None,
        "10.0.0.4": None,
        "10.0.0.5": False,
        "10.0.0.6": None,
    }
    assert (got["10.0.0.2"].gpus(), got["10.0.0.4"].gpus(), got["10.0.0.5"].cpus()) == (2.0, 8.0, 2.0)
    assert [n.node_id for n in got.values()] == ["a1", "b2", "c3", "d4", "e5", "f6"]


def test_alive_nodes_filters_and_sorts_and_finds_the_head():
    nodes = ray_api.alive_nodes([ROW_STATE_DEAD, ROW_STATE, ROW_LOWER, ROW_DEAD, ROW_RAY2X_HEAD, ROW_RAY21])
    assert [n.ip for n in nodes] == ["10.0.0.1", "10.0.0.2", "10.0.0.4", "10.0.0.5"]
    assert ray_api.head_ip(nodes) == "10.0.0.2"


def test_state_api_objects_are_read_like_dicts():
    class NodeState:  # the state API returns dataclass-like objects on current Ray
        node_id, node_ip, state, is_head_node, resources_total = "x", "10.0.0.7", "ALIVE", True, {"CPU": 1.0}

    (node,) = ray_api.alive_nodes([NodeState()])
    assert (node.ip, node.is_head, node.cpus()) == ("10.0.0.7", True, 1.0)


# ---- a real local Ray: its own rows, and pinning ---------------------------------------------------
DEAD_RAY_ADDRESS = "127.0.0.1:9"


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray whose folder is not Ray's default one, as `ray start --temp-dir` makes it (short: Ray's
    socket paths must fit 107 bytes)."""
    ray = pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="akt-ray-", dir="/tmp")
    # Workers inherit the raylet's environment, which this process starts: the kit is importable there from
    # the first task on. (Ray 2.1 adds the driver's folder by a message to every worker that, under load,
    # can arrive after the first task's import: "No module named 'alpa_job'".)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        # A cluster address nothing answers at (the discard port): "local" must start its own Ray regardless, as
        # it must beside a cluster `ray start` left on the machine (Ray's own lookup without an address joins it).
        env.setenv("RAY_ADDRESS", DEAD_RAY_ADDRESS)
        joined = ray_api.join_ray(ray_api.LOCAL, num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    try:
        ray.temp_dir = temp_dir
        ray.joined = joined
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_local_starts_its_own_ray_while_ray_address_names_another(local_ray):
    (node,) = ray_api.alive_nodes()
    assert local_ray.joined == "local Ray (in-process)" and node.alive
    assert local_ray._private.worker.global_worker.node.gcs_address != DEAD_RAY_ADDRESS


def test_failure_hints_name_the_log_folder_ray_really_uses(local_ray):
    from alpa_job.launch import failures

    assert ray_api.logs_dir().startswith(local_ray.temp_dir + os.sep)
    # A JAX process describes its own node's folder (the driver may be elsewhere).
    described = local_ray.get(local_ray.remote(num_cpus=0)(failures.describe_self).remote(0), timeout=60)
    slot = failures.Slot(**described)
    assert slot.log_dir.startswith(local_ray.temp_dir + os.sep)
    lost = slot.lost(step=3, reason="exit code 1")
    message = failures.failure_message(lost, slot, checkpoint_step=2, log_shown=False)
    assert slot.log_dir in message and "/tmp/ray/" not in message, message


def test_real_rows_parse_on_this_ray(local_ray):
    ip = local_ray.util.get_node_ip_address()
    (node,) = ray_api.alive_nodes()
    assert node.ip == ip and node.alive and node.cpus() == 1.0 and node.node_id
    assert ray_api.head_ip([node]) == ip  # by the head marker (current Ray) or the GCS address (2.1.0)
    # (The state API's rows need the dashboard, which this Ray does not start: its row shape is above.)


def test_pin_to_node_runs_there_and_only_there(local_ray):
    ray = local_ray
    ip = ray.util.get_node_ip_address()

    @ray.remote(num_cpus=0)
    def where():
        return ray.util.get_node_ip_address()

    assert ray.get(where.options(**ray_api.pin_to_node(ip)).remote(), timeout=60) == ip
    elsewhere = where.options(**ray_api.pin_to_node("10.255.255.254")).remote()  # no such node
    ready, _ = ray.wait([elsewhere], timeout=1.0)
    assert not ready, "a task pinned to a missing node must not run anywhere else"
    ray.cancel(elsewhere, force=True)


def test_hints_without_a_spec_name_the_users_gcs_port(monkeypatch, tmp_path):
    """Callers that hold no spec (wait_nodes, the job's default) still hint the port the user's spec sets."""
    from alpa_job.cluster.spec import SPEC_ENV_VAR

    path = tmp_path / "c.yaml"
    path.write_text("ports: {gcs: 6390}\n")
    monkeypatch.setenv(SPEC_ENV_VAR, str(path))
    with pytest.raises(KitError, match=r"pass the GCS address HOST:6390$"):
        ray_api.normalize_address("http://10.0.0.1:8265")
    with pytest.raises(KitError, match=r"is not HOST:PORT; .* like 10\.0\.0\.1:6390$"):
        ray_api.normalize_address("10.0.0.1")  # no spec given: a bare host is not completed
