"""The exact `ray start` command for a node, with every port pinned from the cluster spec.

Ray's defaults pick random ports for the node manager, object manager, dashboard agent and metrics;
behind a firewall such a node joins and looks alive, yet tasks on it hang until the head's health
check declares it dead, more than a minute later. So every port Ray would otherwise choose is passed explicitly, and `--node-ip-address`
is always given (Ray's default-route guess picks the wrong NIC on multi-NIC hosts).

CLI (Ansible and the test bed call it):
    python -m alpa_job.cluster.ray_start --role head --node-ip 10.0.0.1
    python -m alpa_job.cluster.ray_start --role worker --node-ip 10.0.0.2 --head-ip 10.0.0.1
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from typing import List, Optional, Tuple

from alpa_job.cluster.ray_api import gcs_address
from alpa_job.cluster.spec import ClusterSpec, load_spec
from alpa_job.errors import KitError

ROLES = ("head", "worker")
# `--runtime-env-agent-port` appeared in Ray 2.8; 2.1.0 (Alpa's pin) refuses the flag.
RUNTIME_ENV_AGENT_FLAG_SINCE = (2, 8)


def parse_ray_version(version: str) -> Tuple[int, int, int]:
    """(major, minor, patch) of a Ray version string such as "2.60.0", "2.1.0" or "2.8.0rc1"."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if not match:
        raise KitError("ray version %r is not of the form MAJOR.MINOR[.PATCH]; pass e.g. 2.60.0" % (version,))
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def ray_start_args(
    spec: ClusterSpec,
    role: str,
    node_ip: str,
    head_ip: Optional[str] = None,
    ray_version: Optional[str] = None,
    num_cpus: Optional[int] = None,
    num_gpus: Optional[int] = None,
    object_store_memory: Optional[int] = None,
    include_dashboard: bool = True,
    block: bool = False,
) -> List[str]:
    """The `ray start` argv (starting with "ray", "start") for one node.

    `ray_version` defaults to the spec's versions.ray_modern; pass versions.ray_legacy for the Alpa
    image. `head_ip` is required for workers (they join HEAD:gcs).
    """
    if role not in ROLES:
        raise KitError("role must be 'head' or 'worker', not %r" % (role,))
    version = parse_ray_version(ray_version if ray_version is not None else spec.versions["ray_modern"])
    node_ip = _member_ip(spec, node_ip, "node IP")
    ports = spec.ports
    workers_lo, workers_hi = spec.ranges["ray_workers"]

    args = ["ray", "start"]
    if role == "head":
        if head_ip is not None and _member_ip(spec, head_ip, "head IP") != node_ip:
            raise KitError("head IP %s differs from this head's node IP %s; drop --head-ip on the head" % (head_ip, node_ip))
        args += ["--head", "--node-ip-address=%s" % node_ip, "--port=%d" % ports["gcs"]]
        if include_dashboard:
            # Bind on all interfaces: `ray job submit` reaches the jobs API from other nodes; the
            # firewall, not the bind address, decides who may connect.
            args += ["--dashboard-host=0.0.0.0", "--dashboard-port=%d" % ports["dashboard"]]
        args += ["--ray-client-server-port=%d" % ports["client"]]
    else:
        if head_ip is None:
            raise KitError("a worker needs the head's IP to join; pass head_ip (--head-ip)")
        head_ip = _member_ip(spec, head_ip, "head IP")
        args += ["--address=%s" % gcs_address(spec, head_ip), "--node-ip-address=%s" % node_ip]

    args += [
        "--node-manager-port=%d" % ports["node_manager"],
        "--object-manager-port=%d" % ports["object_manager"],
        "--min-worker-port=%d" % workers_lo,  # Ray's worker port bounds are inclusive, like the spec's
        "--max-worker-port=%d" % workers_hi,
        "--dashboard-agent-grpc-port=%d" % ports["dashboard_agent_grpc"],
        "--dashboard-agent-listen-port=%d" % ports["dashboard_agent_listen"],
        "--metrics-export-port=%d" % ports["metrics_export"],
    ]
    if version[:2] >= RUNTIME_ENV_AGENT_FLAG_SINCE:
        args.append("--runtime-env-agent-port=%d" % ports["runtime_env_agent"])
    if num_cpus is not None:
        args.append("--num-cpus=%d" % _count(num_cpus, "num_cpus"))
    if num_gpus is not None:
        args.append("--num-gpus=%d" % _count(num_gpus, "num_gpus"))
    if object_store_memory is not None:
        args.append("--object-store-memory=%d" % _count(object_store_memory, "object_store_memory"))
    if role == "head" and not include_dashboard:
        args.append("--include-dashboard=false")
    if block:
        args.append("--block")
    return args


def ray_start_command(spec: ClusterSpec, role: str, node_ip: str, **kwargs) -> str:
    """`ray_start_args(...)` as one shell-quoted command line."""
    return " ".join(shlex.quote(a) for a in ray_start_args(spec, role, node_ip, **kwargs))


def _member_ip(spec: ClusterSpec, ip: str, what: str) -> str:
    return spec.cluster_ipv4(
        ip,
        what,
        "pass this node's cluster IPv4 address",
        "use the node's address on the cluster network (python -m alpa_job.cluster.node_ip prints it) "
        "or fix cluster_cidr in your cluster spec",
    )


def _count(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KitError("%s must be a whole number >= 0, not %r" % (name, value))
    return value


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m alpa_job.cluster.ray_start",
        description="Print the `ray start` command for this node, every port pinned from the cluster spec.",
    )
    parser.add_argument("--role", required=True, choices=ROLES)
    parser.add_argument("--node-ip", required=True, help="this node's address inside cluster_cidr")
    parser.add_argument("--head-ip", help="the head's address (workers)")
    parser.add_argument("--spec", help="cluster spec YAML merged over the defaults (default: $ALPA_KIT_CLUSTER_SPEC)")
    parser.add_argument("--ray-version", help="Ray version on the node (default: the spec's versions.ray_modern)")
    parser.add_argument("--num-cpus", type=int)
    parser.add_argument("--num-gpus", type=int)
    parser.add_argument("--object-store-memory", type=int, help="bytes")
    parser.add_argument("--no-dashboard", action="store_true", help="head: start without the dashboard")
    parser.add_argument("--block", action="store_true", help="keep `ray start` in the foreground (containers)")
    opts = parser.parse_args(argv)
    try:
        command = ray_start_command(
            load_spec(opts.spec),
            opts.role,
            opts.node_ip,
            head_ip=opts.head_ip,
            ray_version=opts.ray_version,
            num_cpus=opts.num_cpus,
            num_gpus=opts.num_gpus,
            object_store_memory=opts.object_store_memory,
            include_dashboard=not opts.no_dashboard,
            block=opts.block,
        )
    except KitError as err:
        print("error: %s" % err, file=sys.stderr)
        return err.exit_code
    print(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
