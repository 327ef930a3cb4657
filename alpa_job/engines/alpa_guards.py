"""Guards that turn Alpa's known failures into one-line errors with the fix.

Pure functions, no `import alpa` (tested on any Python >= 3.9 without Alpa's CUDA jaxlib):

* `check_alpa_version`      refuse alpa < 0.2.3 (its XLA server bound the head's IP -> errno 99)
* `apply_xla_port_env`      XLA_SERVER_PORT_START/END from the cluster spec, env + global_config
* `refuse_ray_client`       Alpa does not work over Ray Client
* `cluster_shape`           num_nodes / num_devices_per_node from Ray's GPU nodes
* `check_driver_on_cluster` the driver must run on a cluster node (ray job submit)
* `SearchGuard`             stop before a second auto stage search (Alpa's NotImplementedError)
* `explain_dump_failure` / `safe_dump_debug_info`
                            dump_debug_info's KeyError / "no attribute 'compiled'" -> the worker log

Alpa's reports of these: https://github.com/alpa-projects/alpa/issues/701 (errno 99),
https://github.com/alpa-projects/alpa/issues/886 (Ray Client),
https://github.com/alpa-projects/alpa/issues/776 (second search).
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, Iterable, List, Mapping, MutableMapping, Optional, Sequence, Tuple

from alpa_job.cluster import ray_api
from alpa_job.errors import KitError

MIN_ALPA = (0, 2, 3)
WORKER_LOG_GLOB = "/tmp/ray/session_latest/logs/worker-*.err"


# ----------------------------------------------------------------------------- versions
def _version_tuple(text: str) -> Tuple[int, ...]:
    parts = []
    for piece in re.split(r"[.+-]", text.strip()):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group(0)))
    return tuple(parts)


def check_alpa_version(version: Optional[str]) -> Tuple[int, ...]:
    """Refuse a missing or too old alpa; returns the parsed version."""
    if not version:
        raise KitError(
            "--engine alpa: the alpa package is not installed here; run inside the kit's Alpa image (alpa==0.2.3) or use --engine jax"
        )
    parsed = _version_tuple(version)
    if not parsed or parsed < MIN_ALPA:
        raise KitError(
            f"alpa {version} is too old: alpa < 0.2.3 binds each node's XLA gRPC server to the HEAD's IP, so "
            "every ProfileWorker/mesh on another node fails with errno 99 'Cannot assign requested address' -> "
            "'Failed to start RPC server' (Alpa issue #701, fixed in 0.2.3 by PR #803); install alpa==0.2.3 "
            "(the kit's Alpa image) on every node"
        )
    return parsed


def installed_alpa_version() -> Optional[str]:
    """alpa's version from package metadata (no import of alpa)."""
    from alpa_job.versions import package_version

    return package_version("alpa")


# ----------------------------------------------------------------------------- ports
def apply_xla_port_env(
    xla_env: Mapping[str, str], environ: Optional[MutableMapping[str, str]] = None, global_config: Any = None
) -> Tuple[int, int]:
    """Put Alpa's XLA gRPC port range in the environment (and alpa.global_config when given).

    Must run BEFORE `import alpa` in the driver (global_env reads the env at import) and the same
    values must reach the workers (pass `ray_env_vars(...)` as the job's runtime_env env_vars):
    Alpa picks a port in [START, END) on whatever node creates a mesh (driver or ProfileWorker).
    """
    try:
        start, end = int(xla_env["XLA_SERVER_PORT_START"]), int(xla_env["XLA_SERVER_PORT_END"])
    except (KeyError, ValueError) as err:
        raise KitError(f"cluster spec gives no valid XLA port range ({err}); set ranges.xla_grpc") from None
    if not 1024 < start < end <= 65536:
        raise KitError(
            f"XLA port range {start}-{end} is not valid (need 1024 < START < END <= 65536); fix ranges.xla_grpc in the cluster spec"
        )
    env = os.environ if environ is None else environ
    env["XLA_SERVER_PORT_START"] = str(start)
    env["XLA_SERVER_PORT_END"] = str(end)
    if global_config is not None:
        global_config.xla_server_port_start = start
        global_config.xla_server_port_end = end
    return start, end


def ray_env_vars(xla_env: Mapping[str, str]) -> Dict[str, str]:
    return {k: str(v) for k, v in xla_env.items() if k.startswith("XLA_SERVER_PORT_")}


# ----------------------------------------------------------------------------- cluster
def refuse_ray_client(address: Optional[str]) -> None:
    if address and address.startswith("ray://"):
        raise KitError(
            "Alpa does not work over Ray Client (ray://, Alpa issue #886); run the driver on a cluster "
            "node: ray job submit --address http://HEAD:8265 -- python -m alpa_job ..."
        )


def cluster_shape(nodes: Iterable[Mapping[str, Any]]) -> Tuple[int, int]:
    """(num_nodes, num_devices_per_node) from `ray.nodes()`: alive nodes with GPUs (a CPU-only head is
    skipped, as Alpa does). Every GPU node must have the same GPU count (Alpa's meshes are uniform)."""
    counts = [int(n.gpus()) for n in ray_api.alive_nodes(nodes) if n.gpus() >= 1]
    if not counts:
        raise KitError(
            "no alive Ray node has a GPU: Alpa runs only on NVIDIA GPU nodes (start each GPU node with "
            "`ray start ... --num-gpus N`, check with `ray status`), or use --engine jax"
        )
    if len(set(counts)) > 1:
        raise KitError(
            f"GPU nodes have different GPU counts {sorted(counts)}; Alpa needs the same number on every "
            f"node: start each with --num-gpus {min(counts)}"
        )
    return len(counts), counts[0]


def check_driver_on_cluster(driver_ip: str, nodes: Iterable[Mapping[str, Any]]) -> None:
    ips = sorted({n.ip for n in ray_api.alive_nodes(nodes)})
    if driver_ip not in ips:
        raise KitError(
            f"the driver runs on {driver_ip}, which is not a node of the Ray cluster ({', '.join(ips)}); "
            "Alpa's driver must run on a cluster node: ray job submit --address http://HEAD:8265 -- "
            "python -m alpa_job train --engine alpa ..."
        )


# ----------------------------------------------------------------------------- second search
def shape_signature(tree: Any) -> Tuple[Tuple[str, Tuple[int, ...], str], ...]:
    """A hashable signature of the shapes/dtypes of a dict/list/tuple tree of arrays (what Alpa's
    executable cache is keyed on, for the batch argument)."""
    out: List[Tuple[str, Tuple[int, ...], str]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, Mapping):
            for k in sorted(node, key=str):
                walk(node[k], f"{path}/{k}" if path else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}" if path else str(i))
        else:
            shape = tuple(int(s) for s in getattr(node, "shape", ()))
            out.append((path, shape, str(getattr(node, "dtype", type(node).__name__))))

    walk(tree, "")
    return tuple(out)


class SearchGuard:
    """Stops a second auto stage search before Alpa raises its NotImplementedError.

    With stage_option auto, Alpa compiles (and searches) per input shape signature; any later
    compile after the first meshes exist raises `NotImplementedError: automatically slicing
    layers with existing physical meshes is not supported yet` -- after a search that may have
    taken many minutes. The kit's batching keeps one shape; this guard catches anything else.
    """

    def __init__(self, auto_search: bool):
        self.auto_search = auto_search
        self.first: Optional[Tuple] = None

    def check(self, signature: Tuple) -> None:
        if self.first is None:
            self.first = signature
            return
        if signature == self.first or not self.auto_search:
            return
        old, new = dict((p, (s, d)) for p, s, d in self.first), dict((p, (s, d)) for p, s, d in signature)
        diff = [f"{p}: {old.get(p)} -> {new.get(p)}" for p in sorted(set(old) | set(new)) if old.get(p) != new.get(p)]
        raise KitError(
            "stopping before a second Alpa auto search: the train step was compiled with stage_option auto for "
            f"one input shape and now gets another ({'; '.join(diff[:4])}). Alpa 0.2.3 cannot search again once "
            "its meshes exist (NotImplementedError 'automatically slicing layers with existing physical meshes', "
            "Alpa issue #776). Keep one batch shape (--drop-remainder or --pad-remainder, the same --batch-size for "
            "every step), or reuse the first search: rerun with --plan-cache DIR (the saved plan is used as a "
            "ManualStageOption), or use --strategy pipeshard-manual"
        )


# ----------------------------------------------------------------------------- dump_debug_info
def _worker_log_hint(err: BaseException) -> Tuple[Optional[str], str]:
    """(node ip, log glob) of the failed Ray worker: RayTaskError's ip/pid attributes when present,
    else its printed header `ray::MeshHostWorker.get_exec_hlo_text() (pid=123, ip=10.0.0.2, ...)`."""
    ip = getattr(err, "ip", None)
    pid = getattr(err, "pid", None)
    m = re.search(r"\(pid=(\d+), ip=([0-9a-fA-F.:]+)", str(err))
    if m:
        pid, ip = pid or int(m.group(1)), ip or m.group(2).rstrip(",")
    pattern = WORKER_LOG_GLOB if not pid else f"/tmp/ray/session_latest/logs/worker-*-{pid}.err"
    return ip, pattern


def explain_dump_failure(err: BaseException, hosts: Sequence[str] = ()) -> Optional[KitError]:
    """The KitError for dump_debug_info's known failure, or None when `err` is something else.

    `KeyError: <uuid>` from MeshHostWorker.get_exec_hlo_text (the worker-side executable never got
    built: compile error, OOM, device-count assert, missing ptxas/NCCL) and its companion
    "object has no attribute 'compiled'" (the half-built executable's __del__).
    """
    text = f"{type(err).__name__}: {err}"
    is_key = isinstance(err, KeyError) or "KeyError" in text
    is_compiled = "no attribute 'compiled'" in text
    if not (is_key or is_compiled):
        return None
    ip, pattern = _worker_log_hint(err)
    where = ip or (", ".join(hosts) if hosts else "the GPU node(s) of the mesh")
    return KitError(
        "dump_debug_info failed with "
        + ("KeyError" if is_key else "\"no attribute 'compiled'\"")
        + ": the worker-side executable of this stage was never built on the mesh's worker (a compile error, "
        "out of memory, a device-count assert, or missing ptxas/NCCL on that node), so its id was never stored. "
        f"The real error is in the Ray worker log on {where}: {pattern} "
        f"(e.g. ssh {ip or '<node>'} 'grep -l -E \"Error|Traceback\" {pattern}')"
    )


def safe_dump_debug_info(dump: Callable[[str], Any], folder: str, hosts: Sequence[str] = ()) -> Any:
    """Call `dump(folder)` (an executable's dump_debug_info); translate the known failure."""
    try:
        return dump(folder)
    except Exception as err:  # noqa: BLE001 - RayTaskError(KeyError) is not a KeyError subclass on every Ray
        kit = explain_dump_failure(err, hosts)
        if kit is None:
            raise
        raise kit from err
