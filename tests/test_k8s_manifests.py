"""k8s/: schema checks against KubeRay v1.7's CRDs and Kubernetes 1.32, and drift checks against the spec.

Every manifest and every kustomize overlay's rendered output (`kubectl kustomize`) is validated:
- Ray CRs (RayCluster, RayJob) against the CRD's openAPIV3Schema for the served version v1, with unknown
  fields refused (what `kubectl apply`'s strict field validation does);
- core objects (NetworkPolicy) and the pod templates inside the Ray CRs with kubernetes-validate (1.32).
Then every port, range, env var, image tag and rayVersion is compared with alpa_job/cluster/cluster.yaml,
and NCCL's fabric variables (with the RDMA device and IPC_LOCK) with spec.nccl_env() of the source's spec
(cluster.yaml, or overlays/rdma/network.yaml merged over it).

The CRDs come from ../shared/kuberay beside the repository (or $ALPA_KIT_KUBERAY_CRDS).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

import jsonschema
import pytest
import yaml

from alpa_job.cluster import kuberay
from alpa_job.cluster.ray_start import RUNTIME_ENV_AGENT_FLAG_SINCE, parse_ray_version
from alpa_job.cluster.spec import ClusterSpec, load_spec, spec_from_dict

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
CRD_DIR = Path(os.environ.get("ALPA_KIT_KUBERAY_CRDS", REPO.parent / "shared" / "kuberay"))
K8S_VERSION = "1.32.0"  # a version kubernetes-validate ships schemas for; matches our kubectl client

# What each rendered source must carry: (images key, versions key).
STACKS = {
    "legacy": ("alpa", "ray_legacy"),
    "modern": ("jax", "ray_modern"),
    "modern-cpu": ("jax_cpu", "ray_modern"),
}
MANIFESTS = {  # plain files, `kubectl apply -f`-able
    "raycluster.yaml": "legacy",
    "networkpolicy.yaml": "legacy",
    "rayjob.yaml": "legacy",
    "rayjob.embedded.yaml": "legacy",
    "rayjob.jax.yaml": "modern",
}
RENDERS = {  # kustomize directories, relative to k8s/
    ".": "legacy",
    "overlays/alpa": "legacy",
    "overlays/jax": "modern",
    "overlays/cpu-smoke": "modern-cpu",
    "overlays/rdma": "modern",
}
# The cluster-spec override a source is rendered from (merged over cluster.yaml); others use cluster.yaml.
SOURCE_SPECS = {"overlays/rdma": K8S / "overlays" / "rdma" / "network.yaml"}
# The RDMA device resource k8s/overlays/rdma requests (the example name of NVIDIA's shared device plugin).
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
# Container port name → cluster.yaml port (names: IANA_SVC_NAME, at most 15 characters).
PORT_NAMES = {
    "gcs-server": "gcs",
    "dashboard": "dashboard",
    "client": "client",
    "metrics": "metrics_export",
    "node-manager": "node_manager",
    "object-manager": "object_manager",
    "agent-grpc": "dashboard_agent_grpc",
    "agent-listen": "dashboard_agent_listen",
    "runtime-env": "runtime_env_agent",
}
HEAD_SERVICE_PORTS = ("gcs-server", "dashboard", "client", "metrics")  # KubeRay's head Service needs them
# rayStartParams key → cluster.yaml port; ranges below. Head-only keys are refused on workers.
PARAM_PORTS = {
    "port": "gcs",
    "dashboard-port": "dashboard",
    "ray-client-server-port": "client",
    "node-manager-port": "node_manager",
    "object-manager-port": "object_manager",
    "dashboard-agent-grpc-port": "dashboard_agent_grpc",
    "runtime-env-agent-port": "runtime_env_agent",
    "metrics-export-port": "metrics_export",
    "dashboard-agent-listen-port": "dashboard_agent_listen",
}
HEAD_ONLY_PARAMS = ("port", "dashboard-port", "ray-client-server-port")
# Ports that only make sense on hosts (no sshd in the pods): left out of the pods' NetworkPolicy.
HOST_ONLY_PORTS = ("ssh",)


# ---------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def spec() -> ClusterSpec:
    return load_spec()


def _need_crds() -> None:
    if not CRD_DIR.is_dir():
        pytest.skip(
            "KubeRay CRDs not found at %s (the shared/ folder beside the repo); "
            "set ALPA_KIT_KUBERAY_CRDS to ray.io_rayclusters.yaml's folder" % CRD_DIR
        )


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        message = "kubectl (with kustomize) is not on PATH; install kubectl >= 1.27 to render k8s/overlays"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def _kv():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: pip install kubernetes-validate==1.37.0")
    return kubernetes_validate


def load_manifest(name: str) -> List[Dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


@lru_cache(maxsize=None)
def _render_text(directory: str) -> str:
    result = subprocess.run([_kubectl(), "kustomize", str(K8S / directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, "kubectl kustomize k8s/%s failed:\n%s" % (directory, result.stderr)
    return result.stdout


def render(directory: str) -> List[Dict[str, Any]]:
    return [d for d in yaml.safe_load_all(_render_text(directory)) if d]


def all_sources() -> List[Tuple[str, str]]:
    return [("file", n) for n in MANIFESTS] + [("kustomize", d) for d in RENDERS]


def load_source(kind: str, name: str) -> List[Dict[str, Any]]:
    return load_manifest(name) if kind == "file" else render(name)


def source_stack(kind: str, name: str) -> str:
    return MANIFESTS[name] if kind == "file" else RENDERS[name]


def source_spec(kind: str, name: str) -> ClusterSpec:
    """The spec a source must match: cluster.yaml, with the source's own override merged over it."""
    override = SOURCE_SPECS.get(name) if kind == "kustomize" else None
    return load_spec(str(override) if override else None)


SOURCE_IDS = ["%s:%s" % s for s in all_sources()]


# ---------------------------------------------------------------- CRD schema


def _strict(node: Any) -> Any:
    """The CRD's OpenAPI v3 schema as a JSON Schema that refuses unknown fields (kubectl's strict mode).

    Structural-schema details are simplified: x-kubernetes-int-or-string becomes integer|string,
    nullable adds null, x-kubernetes-preserve-unknown-fields keeps the object open, other x-kubernetes-*
    keys are ignored.
    """
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = out.get("anyOf") or [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=None)
def crd_validator(kind: str) -> jsonschema.Draft4Validator:
    path = CRD_DIR / ("ray.io_%ss.yaml" % kind.lower())
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 2 MB of YAML
    assert crd["spec"]["names"]["kind"] == kind, path
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"], "KubeRay CRD %s does not serve v1" % path
    return jsonschema.Draft4Validator(_strict(version["schema"]["openAPIV3Schema"]))


def crd_errors(doc: Mapping[str, Any]) -> List[str]:
    validator = crd_validator(doc["kind"])
    return ["%s: %s" % ("/".join(map(str, e.absolute_path)), e.message) for e in validator.iter_errors(doc)]


def cluster_specs(doc: Mapping[str, Any]) -> List[Tuple[str, Mapping[str, Any]]]:
    """(label, RayClusterSpec) inside a RayCluster or a RayJob with an embedded cluster."""
    if doc["kind"] == "RayCluster":
        return [("RayCluster/%s" % doc["metadata"]["name"], doc["spec"])]
    if doc["kind"] == "RayJob" and "rayClusterSpec" in doc["spec"]:
        return [("RayJob/%s.rayClusterSpec" % doc["metadata"]["name"], doc["spec"]["rayClusterSpec"])]
    return []


def groups(cluster: Mapping[str, Any]) -> List[Tuple[str, str, Mapping[str, Any]]]:
    """(role, name, group spec) for the head and each worker group."""
    out = [("head", "head", cluster["headGroupSpec"])]
    out += [("worker", g["groupName"], g) for g in cluster.get("workerGroupSpecs") or []]
    return out


def kuberay_semantic_errors(doc: Mapping[str, Any]) -> List[str]:
    """The operator's own checks (validation.go) that the CRD schema cannot express, for our fields."""
    errors = []
    name = doc["metadata"]["name"]
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 47:
        errors.append("%s name %r: must be a DNS-1035 label of at most 47 characters" % (doc["kind"], name))
    for label, cluster in cluster_specs(doc):
        autoscaling = cluster.get("enableInTreeAutoscaling", False)
        for role, group_name, group in groups(cluster):
            where = "%s %s" % (label, group_name)
            params = group.get("rayStartParams") or {}
            if "labels" in params:
                errors.append("%s: rayStartParams['labels'] is refused; use the group's labels field" % where)
            if role == "worker" and not autoscaling and ("minReplicas" not in group or "maxReplicas" not in group):
                errors.append("%s: set both minReplicas and maxReplicas when autoscaling is off" % where)
            for port in kuberay.ray_container(group).get("ports") or []:
                if not re.fullmatch(r"(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?", port.get("name", "")) or len(port["name"]) > 15:
                    errors.append("%s: container port name %r is no IANA_SVC_NAME (<= 15 chars)" % (where, port.get("name")))
        auth = (cluster.get("authOptions") or {}).get("mode")
        if auth == "token" and parse_ray_version(cluster.get("rayVersion", "0")) < (2, 52, 0):
            errors.append("%s: authOptions.mode token needs rayVersion >= 2.52.0" % label)
    return errors


def pod_templates(doc: Mapping[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    """Each Ray pod template as a core/v1 PodTemplate object, for kubernetes-validate."""
    out = []
    for label, cluster in cluster_specs(doc):
        for _, group_name, group in groups(cluster):
            out.append(
                (
                    "%s %s" % (label, group_name),
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": "%s-%s" % (doc["metadata"]["name"], group_name)},
                        "template": group["template"],
                    },
                )
            )
    return out


def core_k8s_errors(doc: Mapping[str, Any]) -> List[str]:
    kv = _kv()
    objects = [(doc["kind"], doc)] if not doc["apiVersion"].startswith("ray.io/") else pod_templates(doc)
    errors = []
    for label, obj in objects:
        try:
            kv.validate(obj, K8S_VERSION, strict=True)
        except kv.ValidationError as err:
            errors.append("%s: %s" % (label, str(err).splitlines()[0]))
    return errors


# ---------------------------------------------------------------- schema tests


@pytest.mark.parametrize("source", all_sources(), ids=SOURCE_IDS)
def test_ray_custom_resources_match_kuberay_crds(source):
    _need_crds()
    docs = [d for d in load_source(*source) if d["apiVersion"].startswith("ray.io/")]
    assert docs or source == ("file", "networkpolicy.yaml")
    for doc in docs:
        assert doc["apiVersion"] == "ray.io/v1"
        assert crd_errors(doc) == [], "%s/%s" % (doc["kind"], doc["metadata"]["name"])
        assert kuberay_semantic_errors(doc) == []


@pytest.mark.parametrize("source", all_sources(), ids=SOURCE_IDS)
def test_core_objects_and_pod_templates_match_kubernetes_schemas(source):
    docs = load_source(*source)
    assert docs
    for doc in docs:
        assert core_k8s_errors(doc) == [], "%s/%s" % (doc["kind"], doc["metadata"]["name"])


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d["spec"]["headGroupSpec"].__setitem__("rayStartParam", {}), "rayStartParam"),
        (lambda d: d["spec"]["workerGroupSpecs"][0].__setitem__("replica", 2), "replica"),
        (lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].__setitem__("imagee", "x"), "imagee"),
        (lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].__setitem__("port", 6379), "is not of type 'string'"),
        (lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),
    ],
    ids=["typo-rayStartParam", "typo-replica", "typo-in-pod-template", "unquoted-param", "missing-groupName"],
)
def test_crd_validation_catches_mistakes(mutate, expected):
    """The schema check can fail: typos, unquoted params and missing required fields are refused."""
    _need_crds()
    (doc,) = load_manifest("raycluster.yaml")
    assert crd_errors(doc) == []
    bad = copy.deepcopy(doc)
    mutate(bad)
    errors = crd_errors(bad)
    assert errors and any(expected in e for e in errors), errors


def test_kubernetes_validate_catches_mistakes():
    (policy,) = load_manifest("networkpolicy.yaml")
    bad = copy.deepcopy(policy)
    bad["spec"]["ingress"][0]["ports"][0]["endport"] = 7000  # endPort misspelt
    assert any("endport" in e for e in core_k8s_errors(bad))
    (cluster,) = load_manifest("raycluster.yaml")
    bad = copy.deepcopy(cluster)
    bad["spec"]["headGroupSpec"]["template"]["spec"]["tolerations"] = [{"key": "a", "efect": "NoSchedule"}]
    assert any("efect" in e for e in core_k8s_errors(bad))


def test_kuberay_semantic_checks_can_fail():
    (cluster,) = load_manifest("raycluster.yaml")
    bad = copy.deepcopy(cluster)
    del bad["spec"]["workerGroupSpecs"][0]["minReplicas"]
    bad["spec"]["authOptions"] = {"mode": "token"}
    bad["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"][0]["name"] = "dashboard-agent-grpc"
    errors = kuberay_semantic_errors(bad)
    assert len(errors) == 3, errors


# ---------------------------------------------------------------- drift


def expected_params(spec: ClusterSpec, role: str, ray_version: str) -> Dict[str, str]:
    """The port params a group must pin itself (KubeRay adds metrics-export / agent-listen ports)."""
    names = dict(PARAM_PORTS)
    del names["metrics-export-port"], names["dashboard-agent-listen-port"]
    if parse_ray_version(ray_version)[:2] < RUNTIME_ENV_AGENT_FLAG_SINCE:
        del names["runtime-env-agent-port"]  # Ray 2.1.0's `ray start` refuses the flag
    if role == "worker":
        for key in HEAD_ONLY_PARAMS:
            del names[key]
    out = {key: str(spec.ports[port]) for key, port in names.items()}
    lo, hi = spec.ranges["ray_workers"]
    out.update({"min-worker-port": str(lo), "max-worker-port": str(hi), "node-ip-address": "$(MY_POD_IP)"})
    return out


def cluster_drift(spec: ClusterSpec, label: str, cluster: Mapping[str, Any], stack: str) -> List[str]:
    image_key, version_key = STACKS[stack]
    errors = []
    version = cluster.get("rayVersion")
    if version != spec.versions[version_key]:
        errors.append("%s: rayVersion %r != versions.%s %r" % (label, version, version_key, spec.versions[version_key]))
    for role, group_name, group in groups(cluster):
        where = "%s %s" % (label, group_name)
        params = dict(group.get("rayStartParams") or {})
        want = expected_params(spec, role, spec.versions[version_key])
        port_like = {k for k in params if k.endswith("-port") or k in ("port", "node-ip-address")}
        for key in sorted(port_like | set(want)):
            if params.get(key) != want.get(key):
                errors.append("%s: rayStartParams[%r] = %r, plan says %r" % (where, key, params.get(key), want.get(key)))
        # What KubeRay adds by itself must equal the plan too.
        complete = kuberay.complete_params(group, role, head_address="head")
        for key in ("metrics-export-port", "dashboard-agent-listen-port"):
            plan = str(spec.ports[PARAM_PORTS[key]])
            if complete[key] != plan:
                errors.append("%s: KubeRay's --%s=%s != plan's %s" % (where, key, complete[key], plan))
        container = kuberay.ray_container(group)
        if container.get("image") != spec.images[image_key]:
            errors.append("%s: image %r != images.%s %r" % (where, container.get("image"), image_key, spec.images[image_key]))
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        for name, number in ports.items():
            if name not in PORT_NAMES:
                errors.append("%s: container port %s=%s is not in the plan" % (where, name, number))
            elif number != spec.ports[PORT_NAMES[name]]:
                errors.append(
                    "%s: container port %s=%s != ports.%s %s" % (where, name, number, PORT_NAMES[name], spec.ports[PORT_NAMES[name]])
                )
        wanted_names = set(HEAD_SERVICE_PORTS) if role == "head" else set()
        if "runtime-env-agent-port" in want:
            wanted_names.add("runtime-env")
        if wanted_names - set(ports):
            errors.append("%s: container ports lack %s" % (where, sorted(wanted_names - set(ports))))
        env = {e["name"]: e for e in container.get("env") or []}
        for key, value in spec.xla_env().items():
            if env.get(key, {}).get("value") != value:
                errors.append("%s: env %s = %r, plan says %r" % (where, key, env.get(key, {}).get("value"), value))
        if env.get("MY_POD_IP", {}).get("valueFrom") != {"fieldRef": {"fieldPath": "status.podIP"}}:
            errors.append("%s: env MY_POD_IP must come from fieldRef status.podIP" % where)
        if "NCCL_SOCKET_IFNAME" not in env:
            errors.append("%s: env NCCL_SOCKET_IFNAME missing" % where)
        errors += nccl_fabric_drift(spec, where, role, group, env)
        sysctls = {s["name"]: s["value"] for s in (group["template"]["spec"].get("securityContext") or {}).get("sysctls") or []}
        for key, value in spec.sysctl().items():
            if sysctls.get(key) != value:
                errors.append("%s: sysctl %s = %r, plan says %r" % (where, key, sysctls.get(key), value))
    return errors


def nccl_fabric_drift(
    spec: ClusterSpec, where: str, role: str, group: Mapping[str, Any], env: Mapping[str, Mapping[str, Any]]
) -> List[str]:
    """NCCL's fabric and socket variables equal spec.nccl_env(); GPU workers on RDMA get the device and IPC_LOCK."""
    errors = []
    rendered = set(spec.network.socket_env())
    have = {k: e.get("value") for k, e in env.items() if k.startswith("NCCL_IB_") or k in rendered}
    want = spec.nccl_env()
    for key in sorted(set(have) | set(want)):
        if have.get(key) != want.get(key):
            errors.append("%s: env %s = %r, network.fabric %s says %r" % (where, key, have.get(key), spec.network.fabric, want.get(key)))
    container = kuberay.ray_container(group)
    added = ((container.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
    resources = container.get("resources") or {}
    devices = {part: (resources.get(part) or {}).get(RDMA_RESOURCE) for part in ("limits", "requests")}
    wants_rdma = spec.network.rdma and role == "worker"
    if ("IPC_LOCK" in added) != wants_rdma:
        errors.append(
            "%s: capability IPC_LOCK %s, network.fabric is %s" % (where, "added" if "IPC_LOCK" in added else "missing", spec.network.fabric)
        )
    if (devices == {"limits": "1", "requests": "1"}) != wants_rdma or (not wants_rdma and any(devices.values())):
        errors.append("%s: %s %s, network.fabric is %s" % (where, RDMA_RESOURCE, devices, spec.network.fabric))
    return errors


def _span_set(spans) -> set:
    return {(s.lo, s.hi) for s in spans if s.name not in HOST_ONLY_PORTS}


def _rule_ports(rule: Mapping[str, Any]) -> set:
    return {(p["port"], p.get("endPort", p["port"])) for p in rule.get("ports") or []}


def policy_drift(spec: ClusterSpec, policy: Mapping[str, Any], cluster_names: List[str]) -> List[str]:
    errors = []
    selector = policy["spec"]["podSelector"].get("matchLabels") or {}
    target = selector.get("ray.io/cluster")
    if cluster_names and target not in cluster_names:
        errors.append("NetworkPolicy selects ray.io/cluster=%r, the RayCluster is %s" % (target, cluster_names))
    member, admin = set(), set()
    for rule in policy["spec"].get("ingress") or []:
        for peer in rule.get("from") or []:
            if (peer.get("podSelector") or {}).get("matchLabels") == {"ray.io/cluster": target} and "namespaceSelector" not in peer:
                member |= _rule_ports(rule)
            elif "namespaceSelector" in peer:
                admin |= _rule_ports(rule)
    for rule in policy["spec"].get("ingress") or []:
        for port in rule.get("ports") or []:
            if port.get("protocol", "TCP") != "TCP":
                errors.append("NetworkPolicy: %s is not TCP" % port)
    want_member = _span_set(spec.member_tcp_ports())
    if member != want_member:
        errors.append(
            "NetworkPolicy member ports differ from the plan: extra %s, missing %s"
            % (sorted(member - want_member), sorted(want_member - member))
        )
    want_admin = _span_set(spec.admin_tcp_ports())
    if admin != want_admin:
        errors.append(
            "NetworkPolicy admin ports differ from the plan: extra %s, missing %s"
            % (sorted(admin - want_admin), sorted(want_admin - admin))
        )
    return errors


def drift_errors(spec: ClusterSpec, docs: List[Mapping[str, Any]], stack: str) -> List[str]:
    errors = []
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "RayCluster"]
    for doc in docs:
        for label, cluster in cluster_specs(doc):
            errors += cluster_drift(spec, label, cluster, stack)
        if doc["kind"] == "NetworkPolicy":
            errors += policy_drift(spec, doc, names)
        if doc["kind"] == "RayJob" and parse_ray_version(spec.versions[STACKS[stack][1]]) < (2, 6, 0):
            # KubeRay passes these as `ray job submit` flags that Ray 2.1.0 lacks (2.2.0 / 2.6.0).
            for key in ("entrypointNumCpus", "entrypointNumGpus", "entrypointResources", "metadata"):
                if key in doc["spec"]:
                    errors.append(
                        "RayJob %s: %s must stay unset with Ray %s" % (doc["metadata"]["name"], key, spec.versions[STACKS[stack][1]])
                    )
        if doc["kind"] == "RayJob" and "clusterSelector" in doc["spec"]:
            (rc,) = load_manifest("raycluster.yaml")
            if doc["spec"]["clusterSelector"] != {"ray.io/cluster": rc["metadata"]["name"]}:
                errors.append(
                    "RayJob %s selects %s, not k8s/raycluster.yaml's cluster" % (doc["metadata"]["name"], doc["spec"]["clusterSelector"])
                )
    return errors


@pytest.mark.parametrize("source", all_sources(), ids=SOURCE_IDS)
def test_manifests_match_the_cluster_spec(source):
    assert drift_errors(source_spec(*source), load_source(*source), source_stack(*source)) == []


def _mutated(spec: ClusterSpec, section: str, key: str, value: Any) -> ClusterSpec:
    raw = copy.deepcopy(spec.as_dict())
    raw[section][key] = value
    return spec_from_dict(raw, source="mutated copy")


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("ports", "node_manager", 9076, "node-manager-port"),
        ("ports", "gcs", 6380, "'port'"),
        ("ports", "metrics_export", 9090, "metrics-export-port"),
        ("ports", "dashboard_agent_listen", 52366, "dashboard-agent-listen-port"),
        ("ranges", "ray_workers", [10002, 18999], "max-worker-port"),
        ("ranges", "xla_grpc", [20000, 24998], "XLA_SERVER_PORT_END"),
        ("ranges", "ephemeral", [41000, 49999], "ip_local_port_range"),
        ("images", "alpa", "alpa-cluster-kit/alpa:0.2.4", "image"),
        ("versions", "ray_legacy", "2.2.0", "rayVersion"),
        ("network", "fabric", "ib", "env NCCL_IB_DISABLE = '1', network.fabric ib says '0'"),
        ("network", "fabric", "roce", "capability IPC_LOCK missing"),
    ],
    ids=lambda v: str(v),
)
def test_drift_check_fails_when_the_spec_differs(spec, section, key, value, expected):
    if section == "ranges" and key == "xla_grpc":
        raw = copy.deepcopy(spec.as_dict())
        raw["jax_coordinator_port"] = value[1]
        raw["ranges"][key] = value
        other = spec_from_dict(raw, source="mutated copy")
    else:
        other = _mutated(spec, section, key, value)
    docs = load_manifest("raycluster.yaml") + load_manifest("networkpolicy.yaml")
    errors = drift_errors(other, docs, "legacy")
    assert any(expected in e for e in errors), errors


def test_drift_check_fails_when_a_manifest_differs(spec):
    docs = load_manifest("raycluster.yaml") + load_manifest("networkpolicy.yaml")
    bad = copy.deepcopy(docs)
    del bad[0]["spec"]["workerGroupSpecs"][0]["rayStartParams"]["object-manager-port"]  # random again
    bad[1]["spec"]["ingress"][0]["ports"].pop()  # ephemeral range closed
    worker = kuberay.ray_container(bad[0]["spec"]["workerGroupSpecs"][0])
    worker["env"] = [e for e in worker["env"] if e["name"] != "NCCL_SOCKET_NTHREADS"]  # NCCL's single-thread default
    errors = drift_errors(spec, bad, "legacy")
    assert any("object-manager-port" in e for e in errors), errors
    assert any("missing [(40000, 49999)]" in e for e in errors), errors
    assert any("env NCCL_SOCKET_NTHREADS = None, network.fabric ethernet says '4'" in e for e in errors), errors
    (job,) = copy.deepcopy(load_manifest("rayjob.yaml"))
    job["spec"]["entrypointNumCpus"] = 1
    assert any("entrypointNumCpus" in e for e in drift_errors(spec, [job], "legacy"))


# ---------------------------------------------------------------- overlays


def test_overlays_render_what_each_stack_needs(spec):
    legacy, modern, cpu = (render(d) for d in ("overlays/alpa", "overlays/jax", "overlays/cpu-smoke"))
    assert render(".") == legacy  # `kubectl apply -k k8s` is the alpa overlay
    assert sorted(d["kind"] for d in legacy) == ["NetworkPolicy", "RayCluster"]

    def cluster(docs):
        return next(d for d in docs if d["kind"] == "RayCluster")["spec"]

    assert "authOptions" not in cluster(legacy)  # Ray 2.1.0 has no token auth
    for docs in (modern, cpu):
        assert cluster(docs)["authOptions"] == {"mode": "token"}
    gpu = cluster(modern)["workerGroupSpecs"][0]
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == gpu["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu["template"]["spec"]["tolerations"]
    assert gpu["template"]["spec"]["nodeSelector"]
    for _, _, group in groups(cluster(cpu)):
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        assert not any("gpu" in k for part in container["resources"].values() for k in part)
        assert "tolerations" not in pod and "nodeSelector" not in pod
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in container["env"]
        assert kuberay.quantity_value(container["resources"]["limits"]["cpu"]) <= 2


def test_rdma_overlay_is_the_jax_overlay_plus_the_fabric_only():
    """Take the fabric's additions out of the rdma render and the jax render is left, field for field."""
    spec = source_spec("kustomize", "overlays/rdma")
    assert spec.network.rdma and spec.nccl_env()["NCCL_IB_DISABLE"] == "0"
    rdma = copy.deepcopy(render("overlays/rdma"))
    for doc in rdma:  # the base's socket settings survive the overlay's patches by env index
        for _, cluster in cluster_specs(doc):
            for _, _, group in groups(cluster):
                env = {e["name"]: e.get("value") for e in kuberay.ray_container(group)["env"]}
                assert spec.network.socket_env().items() <= env.items()
    for doc in rdma:
        for _, cluster in cluster_specs(doc):
            for role, _, group in groups(cluster):
                container = kuberay.ray_container(group)
                container["env"] = [e for e in container["env"] if e["name"] not in ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX")]
                for e in container["env"]:
                    if e["name"] == "NCCL_IB_DISABLE":
                        e["value"] = "1"
                if role == "worker":
                    assert container.pop("securityContext") == {"capabilities": {"add": ["IPC_LOCK"]}}
                    for part in ("limits", "requests"):
                        assert container["resources"][part].pop(RDMA_RESOURCE) == "1"
    assert rdma == render("overlays/jax")


def test_rdma_overlay_drift_is_caught_against_its_own_spec():
    docs = render("overlays/rdma")
    # Against cluster.yaml's default (ethernet) the overlay is wrong: IB on, devices requested.
    errors = drift_errors(load_spec(), docs, "modern")
    assert any("env NCCL_IB_DISABLE = '0', network.fabric ethernet says '1'" in e for e in errors), errors
    assert any("capability IPC_LOCK added" in e for e in errors), errors
    # Against its own network.yaml with another GID index, the env value is caught.
    raw = source_spec("kustomize", "overlays/rdma").as_dict()
    raw["network"]["ib_gid_index"] = 5
    errors = drift_errors(spec_from_dict(raw, source="mutated copy"), docs, "modern")
    assert any("env NCCL_IB_GID_INDEX = '3', network.fabric roce says '5'" in e for e in errors), errors


def test_kuberay_adds_metrics_and_agent_ports_equal_to_the_plan(spec):
    """KubeRay hard-codes --metrics-export-port=8080 and --dashboard-agent-listen-port=52365."""
    assert kuberay.DEFAULT_METRICS_PORT == str(spec.ports["metrics_export"])
    assert kuberay.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT == str(spec.ports["dashboard_agent_listen"])
    (cluster,) = load_manifest("raycluster.yaml")
    for role, _, group in groups(cluster["spec"]):
        params = group["rayStartParams"]
        assert "metrics-export-port" not in params and "dashboard-agent-listen-port" not in params
        argv = kuberay.ray_start_argv(group, role, pod_ip="10.0.0.9", head_group=cluster["spec"]["headGroupSpec"])
        assert "--metrics-export-port=%d" % spec.ports["metrics_export"] in argv
        assert "--dashboard-agent-listen-port=%d" % spec.ports["dashboard_agent_listen"] in argv


def test_readme_documents_install_and_every_overlay():
    text = (K8S / "README.md").read_text()
    for needle in ["kuberay-operator", "--version 1.7.0", "--server-side", "kubectl create -f"] + [
        "k8s/overlays/%s" % o for o in ("alpa", "jax", "cpu-smoke", "rdma")
    ]:
        assert needle in text, needle
