"""The `ray start` command KubeRay generates for a RayCluster group, without a Kubernetes cluster.

A port-for-port model of KubeRay v1.7's `BuildPod` (ray-operator/controllers/ray/common/pod.go:
`setMissingRayStartParams`, `generateRayStartCommand`, `convertParamMap`), so that the command lines of
k8s/raycluster.yaml can be compared with `alpa_job.cluster.ray_start` and run on test-bed hosts:

- rayStartParams are strings; keys are emitted sorted, as `--key=value`; "true" (any case) becomes the bare
  flag `--key`, "false" is dropped, except for log-color, include-dashboard and include-log-monitor,
  which keep `--key=false`.
- workers get `--address=<head-svc FQDN>:<head's port param, default 6379>`; the head gets
  `--dashboard-host=0.0.0.0`; every node gets `--metrics-export-port=8080`, `--block` and
  `--dashboard-agent-listen-port=52365` unless the params already set them (`--block` always).
- `--num-cpus` (CPU limit, else request, rounded up), `--memory` (memory limit in bytes) and `--num-gpus`
  (first limit, by sorted name, ending in "gpu" or a MIG profile) come from the Ray container (index 0).
- the result is the container's args `ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start ...`,
  run by `/bin/bash -c --`; Kubernetes first expands `$(VAR)` from the container's env (here: a value, or
  a `fieldRef` to status.podIP, given as `pod_ip`).

Not modelled (ValueError if used): the group-level `resources` / `labels` fields, custom accelerators
(TPU, Neuron), autoscaler's `--no-monitor`, GCS fault tolerance, TLS.
"""

from __future__ import annotations

import math
import re
import shlex
from decimal import Decimal
from typing import Any, Dict, List, Mapping, Optional

# KubeRay constants (ray-operator/controllers/ray/utils/constant.go).
DEFAULT_GCS_PORT = "6379"  # KubeRay's own default, not the spec's: k8s/ sets `port` from the spec
DEFAULT_METRICS_PORT = "8080"
DEFAULT_DASHBOARD_AGENT_LISTEN_PORT = "52365"
DEFAULT_CLUSTER_DOMAIN = "cluster.local"
ULIMIT_PREFIX = "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; "
# Boolean-valued flags that keep an explicit "=false" (convertParamMap's specialParameterOptions).
KEEP_FALSE = ("log-color", "include-dashboard", "include-log-monitor")

_MIG = re.compile(r"nvidia\.com/mig-\d+g\.\d+gb$")
_SUFFIX = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")
_VAR_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def quantity_value(quantity: Any) -> int:
    """A Kubernetes resource quantity as KubeRay reads it (`Quantity.Value()`: rounded up to an integer)."""
    text = str(quantity).strip()
    match = _QUANTITY.match(text)
    if not match:
        raise ValueError("%r is not a Kubernetes quantity (e.g. 500m, 4, 16Gi)" % (quantity,))
    number, exponent, suffix = match.groups()
    value = Decimal(number) * (Decimal(10) ** int(exponent[1:]) if exponent else _SUFFIX[suffix or ""])
    return int(math.ceil(value))


def head_service_fqdn(cluster_name: str, namespace: str = "default", domain: str = DEFAULT_CLUSTER_DOMAIN) -> str:
    """`<cluster>-head-svc.<namespace>.svc.<domain>`: the address KubeRay gives workers."""
    return "%s-head-svc.%s.svc.%s" % (cluster_name, namespace, domain)


def complete_params(group: Mapping[str, Any], role: str, head_address: str = "", head_port: str = DEFAULT_GCS_PORT) -> Dict[str, str]:
    """The group's rayStartParams with what KubeRay adds (address, dashboard-host, metrics, block, listen
    port, num-cpus, memory, num-gpus). `head_address` is the host workers join (for workers only)."""
    if role not in ("head", "worker"):
        raise ValueError("role must be 'head' or 'worker', not %r" % (role,))
    for unmodelled in ("resources", "labels"):
        if group.get(unmodelled):
            raise ValueError("group-level %r is not modelled; set rayStartParams instead" % unmodelled)
    params = {str(k): _param_string(k, v) for k, v in (group.get("rayStartParams") or {}).items()}
    if role == "worker":
        params.setdefault("address", "%s:%s" % (head_address, head_port))
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", DEFAULT_METRICS_PORT)
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", DEFAULT_DASHBOARD_AGENT_LISTEN_PORT)

    resources = ray_container(group).get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if "num-cpus" not in params:
        cpu = limits.get("cpu") if quantity_value(limits.get("cpu", 0)) else requests.get("cpu")
        if cpu is not None and quantity_value(cpu):
            params["num-cpus"] = str(quantity_value(cpu))
    if "memory" not in params and quantity_value(limits.get("memory", 0)):
        params["memory"] = str(quantity_value(limits["memory"]))
    if "num-gpus" not in params:
        for name in sorted(limits):
            if (name.endswith("gpu") or _MIG.search(name)) and quantity_value(limits[name]):
                params["num-gpus"] = str(quantity_value(limits[name]))
                break
    return params


def ray_start_string(params: Mapping[str, str], role: str) -> str:
    """KubeRay's `ray start` string for complete params (convertParamMap's spacing included)."""
    flags = ""
    for key in sorted(params):
        value = params[key]
        if value.lower() in ("true", "false") and key not in KEEP_FALSE:
            if value.lower() == "true":
                flags += " --%s " % key
        else:
            flags += " --%s=%s " % (key, value)
    return ("ray start --head %s" if role == "head" else "ray start %s") % flags


def container_args(
    group: Mapping[str, Any],
    role: str,
    cluster_name: str,
    namespace: str = "default",
    pod_ip: Optional[str] = None,
    head_address: Optional[str] = None,
    head_port: str = DEFAULT_GCS_PORT,
) -> str:
    """The Ray container's single bash argument as the pod runs it (after Kubernetes' `$(VAR)` expansion).

    `head_address` defaults to the head Service's FQDN; pass an IP to compare with a bare-metal node.
    `head_port` is the head group's `port` param (KubeRay's GetHeadPort), used in workers' --address.
    """
    host = head_address if head_address is not None else head_service_fqdn(cluster_name, namespace)
    params = complete_params(group, role, head_address=host, head_port=head_port)
    command = ULIMIT_PREFIX + ray_start_string(params, role)
    return expand_env_refs(command, container_env(group, pod_ip))


def ray_start_argv(
    group: Mapping[str, Any],
    role: str,
    cluster_name: str = "alpa",
    namespace: str = "default",
    pod_ip: Optional[str] = None,
    head_address: Optional[str] = None,
    head_group: Optional[Mapping[str, Any]] = None,
) -> List[str]:
    """`ray start ...` as an argv list (bash word splitting of KubeRay's command, ulimit dropped).

    For workers pass the `head_group` so its `port` param (the GCS port KubeRay puts in --address) is used.
    """
    head_port = DEFAULT_GCS_PORT
    if head_group is not None:
        head_port = _param_string("port", (head_group.get("rayStartParams") or {}).get("port", DEFAULT_GCS_PORT))
    command = container_args(group, role, cluster_name, namespace, pod_ip=pod_ip, head_address=head_address, head_port=head_port)
    return shlex.split(command[len(ULIMIT_PREFIX) :])


def cluster_argvs(
    raycluster: Mapping[str, Any], pod_ips: Mapping[str, str], namespace: str = "default", head_address: Optional[str] = None
) -> Dict[str, List[str]]:
    """argv per group of a RayCluster object ("head" and each worker groupName), given a pod IP per group."""
    spec = raycluster["spec"]
    name = raycluster["metadata"]["name"]
    head = spec["headGroupSpec"]
    out = {"head": ray_start_argv(head, "head", name, namespace, pod_ip=pod_ips.get("head"))}
    for group in spec.get("workerGroupSpecs") or []:
        out[group["groupName"]] = ray_start_argv(
            group,
            "worker",
            name,
            namespace,
            pod_ip=pod_ips.get(group["groupName"]),
            head_address=head_address,
            head_group=head,
        )
    return out


def ray_container(group: Mapping[str, Any]) -> Mapping[str, Any]:
    """The Ray container: KubeRay's RayContainerIndex is 0."""
    return group["template"]["spec"]["containers"][0]


def container_env(group: Mapping[str, Any], pod_ip: Optional[str] = None) -> Dict[str, str]:
    """The Ray container's env values that `$(VAR)` can refer to (status.podIP resolved to `pod_ip`)."""
    env: Dict[str, str] = {}
    for item in ray_container(group).get("env") or []:
        if "value" in item:
            env[item["name"]] = expand_env_refs(str(item["value"]), env)
        elif ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") == "status.podIP":
            if pod_ip is not None:
                env[item["name"]] = pod_ip
    return env


def expand_env_refs(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of `$(VAR)` in command/args: unknown references stay as written, `$$` is `$`."""

    def repl(match: "re.Match[str]") -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR_REF.sub(repl, text)


def _param_string(key: Any, value: Any) -> str:
    if not isinstance(value, str):
        # The CRD types rayStartParams as map[string]string: an unquoted 8076 is refused by the API server.
        raise ValueError('rayStartParams[%r] must be a string (quote it: "%s")' % (key, value))
    return value
