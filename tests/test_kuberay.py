"""alpa_job.cluster.kuberay: KubeRay's `ray start` rules, and k8s/ ≡ alpa_job.cluster.ray_start."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import yaml

from alpa_job.cluster import kuberay
from alpa_job.cluster.ray_start import ray_start_args
from alpa_job.cluster.spec import load_spec

K8S = Path(__file__).resolve().parents[1] / "k8s"
HEAD_IP, WORKER_IP = "10.0.0.1", "10.0.0.2"
# Flags that differ by design: KubeRay keeps `ray start` in the foreground and sizes nodes from limits.
NOT_COMPARED = ("--block", "--num-cpus", "--num-gpus", "--memory", "--object-store-memory", "--resources")


def flags(argv: List[str]) -> Dict[str, Optional[str]]:
    """`ray start` argv as {flag: value or None}; accepts `--f=v` and `--f v`."""
    assert argv[:2] == ["ray", "start"], argv
    out: Dict[str, Optional[str]] = {}
    rest = argv[2:]
    i = 0
    while i < len(rest):
        item = rest[i]
        assert item.startswith("--"), argv
        if "=" in item:
            key, value = item.split("=", 1)
        elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            key, value = item, rest[i + 1]
            i += 1
        else:
            key, value = item, None
        assert key not in out, "%s given twice" % key
        out[key] = value
        i += 1
    return out


def group(params=None, limits=None, requests=None, env=None) -> dict:
    container = {"name": "ray", "image": "x", "resources": {}}
    if limits:
        container["resources"]["limits"] = limits
    if requests:
        container["resources"]["requests"] = requests
    if env:
        container["env"] = env
    return {"rayStartParams": params or {}, "template": {"spec": {"containers": [container]}}}


# ---------------------------------------------------------------- KubeRay's rules


def test_head_gets_dashboard_host_metrics_block_and_listen_port():
    argv = kuberay.ray_start_argv(group({"port": "6379"}), "head")
    assert argv == [
        "ray",
        "start",
        "--head",
        "--block",
        "--dashboard-agent-listen-port=52365",
        "--dashboard-host=0.0.0.0",
        "--metrics-export-port=8080",
        "--port=6379",
    ]


def test_worker_joins_the_head_service_fqdn_on_the_head_groups_port():
    head = group({"port": "6380"})
    argv = kuberay.ray_start_argv(group(), "worker", "demo", "ml", head_group=head)
    assert "--address=demo-head-svc.ml.svc.cluster.local:6380" in argv
    assert "--dashboard-host=0.0.0.0" not in argv and "--head" not in argv
    assert "--address=10.9.9.9:6379" in kuberay.ray_start_argv(group(), "worker", head_address="10.9.9.9")


def test_booleans_true_is_bare_false_dropped_except_three():
    params = {
        "disable-usage-stats": "True",
        "no-monitor": "false",
        "log-color": "false",
        "include-dashboard": "false",
        "include-log-monitor": "true",
    }
    argv = kuberay.ray_start_argv(group(params), "head")
    assert "--disable-usage-stats" in argv
    assert not any(a.startswith("--no-monitor") for a in argv)
    assert "--log-color=false" in argv and "--include-dashboard=false" in argv
    assert "--include-log-monitor=true" in argv


def test_params_the_user_set_win_over_kuberays_defaults():
    params = {"metrics-export-port": "9000", "dashboard-agent-listen-port": "52000", "dashboard-host": "127.0.0.1", "num-cpus": "0"}
    argv = kuberay.ray_start_argv(group(params, limits={"cpu": "8"}), "head")
    assert {"--metrics-export-port=9000", "--dashboard-agent-listen-port=52000", "--dashboard-host=127.0.0.1", "--num-cpus=0"} <= set(argv)


def test_resources_from_limits_then_cpu_request():
    argv = kuberay.ray_start_argv(group(limits={"cpu": "1500m", "memory": "2Gi", "nvidia.com/gpu": "4"}), "head")
    assert {"--num-cpus=2", "--memory=2147483648", "--num-gpus=4"} <= set(argv)
    argv = kuberay.ray_start_argv(group(requests={"cpu": "3", "memory": "1Gi"}), "head")
    assert "--num-cpus=3" in argv and not any(a.startswith("--memory") for a in argv)
    argv = kuberay.ray_start_argv(group(limits={"nvidia.com/mig-1g.10gb": "2"}), "head")
    assert "--num-gpus=2" in argv
    argv = kuberay.ray_start_argv(group(limits={"nvidia.com/gpu": "0", "cpu": "1"}), "head")
    assert not any(a.startswith("--num-gpus") for a in argv)


@pytest.mark.parametrize(
    "text, value",
    [
        ("4", 4),
        ("500m", 1),
        ("1.5", 2),
        ("16Gi", 16 * 2**30),
        ("1G", 10**9),
        ("2e3", 2000),
        ("128974848", 128974848),
    ],
)
def test_quantity_value_rounds_up_like_kubernetes(text, value):
    assert kuberay.quantity_value(text) == value


def test_pod_ip_reference_is_expanded_by_kubernetes_rules():
    env = [{"name": "MY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}, {"name": "X", "value": "a-$(MY_POD_IP)"}]
    g = group({"node-ip-address": "$(MY_POD_IP)", "temp-dir": "/t/$(UNKNOWN)/$$(MY_POD_IP)"}, env=env)
    argv = kuberay.ray_start_argv(g, "head", pod_ip="10.1.2.3")
    assert "--node-ip-address=10.1.2.3" in argv
    assert "--temp-dir=/t/$(UNKNOWN)/$(MY_POD_IP)" in argv  # unknown stays; $$ escapes
    assert "--node-ip-address=$(MY_POD_IP)" in kuberay.ray_start_argv(g, "head")  # no pod IP given


def test_container_args_is_kuberays_shell_line():
    line = kuberay.container_args(group({"port": "6379"}), "head", "alpa")
    assert line == (
        "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start --head  --block  "
        "--dashboard-agent-listen-port=52365  --dashboard-host=0.0.0.0  "
        "--metrics-export-port=8080  --port=6379 "
    )


def test_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="must be a string"):
        kuberay.ray_start_argv(group({"port": 6379}), "head")
    with pytest.raises(ValueError, match="not modelled"):
        kuberay.ray_start_argv(dict(group(), resources={"GPU": "1"}), "head")
    with pytest.raises(ValueError, match="role"):
        kuberay.ray_start_argv(group(), "driver")


# ---------------------------------------------------------------- k8s/ ≡ ray_start


def _rendered(directory: str) -> dict:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize) is not on PATH")
    out = subprocess.run([kubectl, "kustomize", str(K8S / directory)], capture_output=True, text=True, check=True, timeout=60).stdout
    return next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "RayCluster")


def _clusters():
    (plain,) = [d for d in yaml.safe_load_all((K8S / "raycluster.yaml").read_text()) if d]
    (job,) = [d for d in yaml.safe_load_all((K8S / "rayjob.embedded.yaml").read_text()) if d]
    yield "raycluster.yaml", lambda: plain["spec"]
    yield "rayjob.embedded.yaml", lambda: job["spec"]["rayClusterSpec"]
    yield "overlays/jax", lambda: _rendered("overlays/jax")["spec"]
    yield "overlays/cpu-smoke", lambda: _rendered("overlays/cpu-smoke")["spec"]
    yield "overlays/rdma", lambda: _rendered("overlays/rdma")["spec"]


@pytest.mark.parametrize("name, get_cluster", list(_clusters()), ids=[n for n, _ in _clusters()])
@pytest.mark.parametrize("role", ["head", "worker"])
def test_kuberay_command_equals_ray_start_args(name, get_cluster, role):
    """The pods start Ray exactly as the bare-metal renderer does (modulo --block and node sizes)."""
    spec = load_spec()
    cluster = get_cluster()
    head = cluster["headGroupSpec"]
    if role == "head":
        ours = kuberay.ray_start_argv(head, "head", pod_ip=HEAD_IP)
        theirs = ray_start_args(spec, "head", HEAD_IP, ray_version=cluster["rayVersion"])
    else:
        ours = kuberay.ray_start_argv(cluster["workerGroupSpecs"][0], "worker", pod_ip=WORKER_IP, head_address=HEAD_IP, head_group=head)
        theirs = ray_start_args(spec, "worker", WORKER_IP, head_ip=HEAD_IP, ray_version=cluster["rayVersion"])
    ours_f = {k: v for k, v in flags(ours).items() if k not in NOT_COMPARED}
    theirs_f = {k: v for k, v in flags(theirs).items() if k not in NOT_COMPARED}
    assert ours_f == theirs_f
    assert ("--head" in ours) == (role == "head") and "--block" in ours


def test_cluster_argvs_gives_one_command_per_group():
    (plain,) = [d for d in yaml.safe_load_all((K8S / "raycluster.yaml").read_text()) if d]
    argvs = kuberay.cluster_argvs(plain, {"head": HEAD_IP, "gpu": WORKER_IP})
    assert set(argvs) == {"head", "gpu"}
    assert "--address=alpa-head-svc.default.svc.cluster.local:6379" in argvs["gpu"]
    assert "--num-gpus=8" in argvs["gpu"] and "--node-ip-address=%s" % WORKER_IP in argvs["gpu"]
