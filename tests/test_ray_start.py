"""`ray start` rendering: exact argv per role and Ray version, refusals, the CLI, and Ray's own parser."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from alpa_job.cluster.ray_start import parse_ray_version, ray_start_args, ray_start_command
from alpa_job.cluster.spec import load_spec
from alpa_job.errors import KitError

REPO = Path(__file__).resolve().parents[1]

PINNED = [
    "--node-manager-port=8076",
    "--object-manager-port=8077",
    "--min-worker-port=10002",
    "--max-worker-port=19999",
    "--dashboard-agent-grpc-port=8078",
    "--dashboard-agent-listen-port=52365",
    "--metrics-export-port=8080",
]
HEAD = [
    "ray",
    "start",
    "--head",
    "--node-ip-address=10.0.0.1",
    "--port=6379",
    "--dashboard-host=0.0.0.0",
    "--dashboard-port=8265",
    "--ray-client-server-port=10001",
]
WORKER = ["ray", "start", "--address=10.0.0.1:6379", "--node-ip-address=10.0.0.2"]


def test_head_argv_ray_2_60(spec):
    args = ray_start_args(spec, "head", "10.0.0.1", ray_version="2.60.0")
    assert args == HEAD + PINNED + ["--runtime-env-agent-port=8079"]


def test_head_argv_ray_2_1_has_no_runtime_env_agent_flag(spec):
    args = ray_start_args(spec, "head", "10.0.0.1", ray_version="2.1.0")
    assert args == HEAD + PINNED


def test_worker_argv_ray_2_60(spec):
    args = ray_start_args(spec, "worker", "10.0.0.2", head_ip="10.0.0.1", ray_version="2.60.0")
    assert args == WORKER + PINNED + ["--runtime-env-agent-port=8079"]


def test_worker_argv_ray_2_1(spec):
    args = ray_start_args(spec, "worker", "10.0.0.2", head_ip="10.0.0.1", ray_version="2.1.0")
    assert args == WORKER + PINNED


def test_default_version_is_the_specs_modern_ray(spec):
    assert ray_start_args(spec, "head", "10.0.0.1") == ray_start_args(spec, "head", "10.0.0.1", ray_version=spec.versions["ray_modern"])


@pytest.mark.parametrize(
    "version, has_flag",
    [
        ("2.1.0", False),
        ("2.7.2", False),
        ("2.8.0", True),
        ("2.8.0rc1", True),
        ("2.10.0", True),
        ("2.60.0", True),
        ("3.0.0.dev0", True),
        ("2.9", True),
    ],
)
def test_runtime_env_agent_flag_follows_the_version_numerically(spec, version, has_flag):
    args = ray_start_args(spec, "worker", "10.0.0.2", head_ip="10.0.0.1", ray_version=version)
    assert ("--runtime-env-agent-port=8079" in args) is has_flag


def test_parse_ray_version():
    assert parse_ray_version("2.60.0") == (2, 60, 0)
    assert parse_ray_version("2.8.0rc1") == (2, 8, 0)
    assert parse_ray_version("2.9") == (2, 9, 0)
    with pytest.raises(KitError, match="MAJOR.MINOR"):
        parse_ray_version("latest")


def test_resources_dashboard_and_block(spec):
    args = ray_start_args(
        spec,
        "head",
        "10.0.0.1",
        ray_version="2.60.0",
        num_cpus=4,
        num_gpus=8,
        object_store_memory=200_000_000,
        include_dashboard=False,
        block=True,
    )
    assert args[-5:] == [
        "--num-cpus=4",
        "--num-gpus=8",
        "--object-store-memory=200000000",
        "--include-dashboard=false",
        "--block",
    ]
    assert not any(a.startswith(("--dashboard-host", "--dashboard-port")) for a in args)


def test_ports_come_from_the_user_spec(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cluster_cidr: 192.168.7.0/24\nports: {gcs: 6380, node_manager: 8176}\n")
    args = ray_start_args(load_spec(str(path)), "worker", "192.168.7.3", head_ip="192.168.7.1")
    assert "--address=192.168.7.1:6380" in args and "--node-manager-port=8176" in args


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(role="head", node_ip="192.168.1.5"), "node IP 192.168.1.5 is not inside cluster_cidr 10.0.0.0/8"),
        (dict(role="worker", node_ip="10.0.0.2"), "a worker needs the head's IP"),
        (dict(role="worker", node_ip="10.0.0.2", head_ip="172.16.0.1"), "head IP 172.16.0.1 is not inside"),
        (dict(role="driver", node_ip="10.0.0.2"), "role must be 'head' or 'worker'"),
        (dict(role="head", node_ip="head-1"), "is not an IP address"),
        (dict(role="head", node_ip="10.0.0.1", head_ip="10.0.0.9"), "differs from this head's node IP"),
        (dict(role="head", node_ip="10.0.0.1", num_gpus=-1), "num_gpus must be a whole number"),
        (dict(role="head", node_ip="10.0.0.1", ray_version="two"), "is not of the form"),
    ],
)
def test_refusals(spec, kwargs, expected):
    with pytest.raises(KitError) as err:
        ray_start_args(spec, **kwargs)
    assert expected in str(err.value)


def test_command_is_the_shell_quoted_argv(spec):
    command = ray_start_command(spec, "worker", "10.0.0.2", head_ip="10.0.0.1", ray_version="2.1.0")
    assert shlex.split(command) == WORKER + PINNED


def _cli(*argv):
    return subprocess.run(
        [sys.executable, "-m", "alpa_job.cluster.ray_start", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_prints_the_command():
    done = _cli("--role", "worker", "--node-ip", "10.0.0.2", "--head-ip", "10.0.0.1", "--ray-version", "2.1.0")
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout) == WORKER + PINNED


def test_cli_reports_user_errors_in_one_line():
    done = _cli("--role", "worker", "--node-ip", "10.0.0.2")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "error: a worker needs the head's IP to join; pass head_ip (--head-ip)"


@pytest.mark.parametrize("role", ["head", "worker"])
def test_installed_rays_own_parser_accepts_the_argv(spec, role):
    """Ray's real click command parses every flag and value (no node is started).

    Runs against whichever Ray is installed: 2.60 in the modern venv, 2.1.0 in a Python 3.9 venv.
    """
    pytest.importorskip("ray", reason="ray is not installed in this environment")
    import ray
    from ray.scripts.scripts import start

    args = ray_start_args(
        spec,
        role,
        "10.0.0.2" if role == "worker" else "10.0.0.1",
        head_ip="10.0.0.1",
        ray_version=ray.__version__,
        num_cpus=2,
        object_store_memory=100_000_000,
        block=True,
    )
    context = start.make_context("start", args[2:])
    assert context.params["node_manager_port"] == 8076
    assert context.params["max_worker_port"] == 19999
    assert context.params["metrics_export_port"] == 8080
    assert context.params["dashboard_agent_grpc_port"] == 8078
    assert context.params["block"] is True
    if parse_ray_version(ray.__version__) >= (2, 8, 0):
        assert context.params["runtime_env_agent_port"] == 8079
    else:  # e.g. Alpa's Ray 2.1.0: the flag we leave out is one this Ray would refuse
        assert "runtime_env_agent_port" not in context.params
        import click

        with pytest.raises(click.NoSuchOption):
            start.make_context("start", args[2:] + ["--runtime-env-agent-port=8079"])
    if role == "head":
        assert context.params["head"] is True and context.params["port"] == 6379
        assert context.params["dashboard_host"] == "0.0.0.0"
    else:
        assert context.params["address"] == "10.0.0.1:6379"
