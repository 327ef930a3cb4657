"""The kit's one way to talk to a Ray cluster: its address, joining it, its alive nodes, pinning to a node.

Every caller (the job, the Alpa engine, the doctor, wait_nodes, tests, benches) goes through these
helpers, so each fact is written once:

- `gcs_address(spec, head_ip)`: the head's GCS address is the head IP and the spec's `gcs` port;
  `normalize_address(...)`: a user's --address checked and completed (a bare host gets that port).
- `join_ray(address, timeout_s)`: `ray.init` with a deadline. Ray retries an address that answers TCP
  but is not a GCS for minutes (and a blocked one forever), so the join runs in a helper thread that the
  caller stops waiting for: past the deadline it is a one-line KitError naming the address, exit 4.
- `parse_node(row)` / `alive_nodes()`: one reader for the rows of `ray.nodes()` ("Alive",
  "NodeManagerAddress", "Resources"), their lower-case "alive" spelling, and the state API's rows
  (`state: ALIVE`, `node_ip`, `resources_total`), dicts or objects.
- `pin_to_node(ip)`: `.options(**pin_to_node(ip))` places a task/actor on the node with that IP, through
  Ray's built-in `node:<ip>` resource. It means the same on Ray 2.1.0 (the Alpa image) and current Ray,
  is keyed by the IP the spec and the doctor speak of (NodeAffinitySchedulingStrategy needs a node id
  looked up first), and is what Alpa itself uses to place its mesh workers.

Imports on the Alpa image's stack (Python 3.9, ray 2.1.0): standard library at module level, ray when used.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

from alpa_job.errors import EXIT_TIMEOUT, KitError

AUTO = "auto"  # Ray finds the cluster this machine runs (RAY_ADDRESS, else /tmp/ray's record)
LOCAL = "local"  # start an in-process Ray: not a join, no address
JOIN_TIMEOUT_S = 30.0
TCP_CHECK_TIMEOUT_S = 10.0
PIN_FRACTION = 0.001  # a sliver of the node's `node:<ip>` resource: never the reason a task waits
HEAD_MARKER = "node:__internal_head__"  # Ray >= ~2.5 gives the head this resource
DEFAULT_LOGS_DIR = "/tmp/ray/session_latest/logs"  # where Ray logs when no --temp-dir moved it


# ---- the GCS address -----------------------------------------------------------------------------
def gcs_address(spec, head_ip: str) -> str:
    """HEAD_IP:GCS_PORT, the port from the cluster spec (`ports.gcs`)."""
    return "%s:%d" % (head_ip, spec.ports["gcs"])


def _gcs_port(spec=None) -> int:
    """The spec's GCS port; without a spec (error hints only), the one the user's spec resolves to."""
    if spec is None:
        from alpa_job.cluster.spec import load_spec  # yaml: imported only on this error path

        spec = load_spec()
    return spec.ports["gcs"]


def split_address(address: str, spec=None) -> Tuple[str, int]:
    """(host, port) of HOST:PORT, or a KitError naming the form expected."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KitError(
            "--address %r is not HOST:PORT; use local, auto, or the head's GCS address like 10.0.0.1:%d" % (address, _gcs_port(spec))
        )
    return host, int(port)


def normalize_address(address: Optional[str], spec=None, default: str = AUTO) -> str:
    """The address to join: None/"" -> $RAY_ADDRESS, else `default`; local/auto/ray:// as given; a bare
    host gets the spec's GCS port; a dashboard URL or a malformed HOST:PORT is a KitError."""
    address = (address or os.environ.get("RAY_ADDRESS") or default).strip()
    if address in (AUTO, LOCAL) or address.startswith("ray://"):
        return address
    if address.startswith(("http://", "https://")):
        raise KitError(
            "--address %s is the dashboard/jobs URL; submit with `ray job submit --address %s -- python "
            "-m alpa_job ...` or pass the GCS address HOST:%d" % (address, address, _gcs_port(spec))
        )
    if ":" not in address and spec is not None:
        return gcs_address(spec, address)
    split_address(address, spec)
    return address


def check_reachable(address: str, timeout_s: float = TCP_CHECK_TIMEOUT_S) -> None:
    """Fail fast (and name the fix) when a GCS address does not answer on TCP."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except socket.timeout:
        raise KitError(
            "Ray GCS at %s did not answer within %.0f s; check that the head is up and that port %d is "
            "open to this host (python -m alpa_job doctor)" % (address, timeout_s, port),
            EXIT_TIMEOUT,
        ) from None
    except OSError as err:
        raise KitError(
            "cannot reach Ray GCS at %s (%s); start the head (ray start --head) or fix --address" % (address, err.strerror or err),
            EXIT_TIMEOUT,
        ) from None


# ---- joining -------------------------------------------------------------------------------------
def join_ray(address: str, timeout_s: float = JOIN_TIMEOUT_S, check_timeout_s: float = TCP_CHECK_TIMEOUT_S, **init_kwargs: Any) -> str:
    """`ray.init(address=...)` that returns or fails within `timeout_s`; returns what was joined.

    `address`: HOST:PORT (TCP-checked first: a refused or silent port fails in seconds), "auto",
    "ray://..." or "local" (starts an in-process Ray: no network wait, so no thread). Already
    connected: nothing to do. Failures are one-line KitErrors naming the address, exit 4.
    `check_timeout_s` caps the first TCP check (within `timeout_s`).
    """
    import ray

    if ray.is_initialized():
        return "already connected"
    if address == LOCAL:
        # Named, not left out: ray.init() without an address joins RAY_ADDRESS or the newest cluster that
        # `ray start` left on this machine, even a dead one.
        ray.init(address=LOCAL, **init_kwargs)
        return "local Ray (in-process)"
    deadline = time.monotonic() + timeout_s
    if address != AUTO and not address.startswith("ray://"):
        check_reachable(address, timeout_s=max(0.1, min(check_timeout_s, timeout_s)))
    outcome: Dict[str, BaseException] = {}

    def init() -> None:
        try:
            ray.init(address=address, **init_kwargs)
        except BaseException as err:  # handed to the caller's thread below
            outcome["error"] = err

    # A daemon thread: when it hangs past the deadline, the caller fails and the process may exit.
    worker = threading.Thread(target=init, name="ray-join", daemon=True)
    worker.start()
    worker.join(max(0.1, deadline - time.monotonic()))
    if worker.is_alive():
        raise KitError(
            "Ray at %s did not accept this driver within %.0f s (something answers there, but not a Ray "
            "GCS that lets it join); pass the head's GCS address (ray start --head --port) and run python "
            "-m alpa_job doctor" % (address, timeout_s),
            EXIT_TIMEOUT,
        )
    err = outcome.get("error")
    if isinstance(err, ConnectionError):
        raise KitError(
            "cannot join Ray at %s (%s); start a cluster (ray start --head) or fix --address" % (address, _first_line(err)), EXIT_TIMEOUT
        ) from None
    if err is not None:
        raise err
    return "Ray cluster at %s" % address


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


# ---- nodes ---------------------------------------------------------------------------------------
class RayNode(NamedTuple):
    """One row of Ray's node table, whichever API or Ray version produced it."""

    ip: str
    node_id: str
    alive: bool
    resources: Mapping[str, float]
    is_head: Optional[bool]  # None: this Ray does not say (2.1.0's ray.nodes())
    row: Any = None  # the row as Ray gave it

    def cpus(self) -> float:
        return float(self.resources.get("CPU", 0) or 0)

    def gpus(self) -> float:
        return float(self.resources.get("GPU", 0) or 0)


def _field(row: Any, *names: str) -> Any:
    for name in names:
        value = row.get(name) if isinstance(row, Mapping) else getattr(row, name, None)
        if value is not None:
            return value
    return None


def parse_node(row: Any) -> RayNode:
    """A `ray.nodes()` row ("Alive" or "alive") or a state API row (`state`), as a RayNode."""
    if isinstance(row, RayNode):
        return row
    alive = _field(row, "Alive", "alive")
    if alive is None:
        alive = str(_field(row, "state") or "").upper() == "ALIVE"
    resources = dict(_field(row, "Resources", "resources_total", "resources") or {})
    is_head = _field(row, "is_head_node")
    if is_head is None and HEAD_MARKER in resources:
        is_head = True
    return RayNode(
        ip=str(_field(row, "NodeManagerAddress", "node_ip", "node_manager_address") or ""),
        node_id=str(_field(row, "NodeID", "node_id") or ""),
        alive=bool(alive),
        resources=resources,
        is_head=None if is_head is None else bool(is_head),
        row=row,
    )


def parse_nodes(rows: Iterable[Any]) -> List[RayNode]:
    return [parse_node(row) for row in rows]


def alive_nodes(rows: Optional[Iterable[Any]] = None) -> List[RayNode]:
    """The alive nodes among `rows` (default: the connected cluster's `ray.nodes()`), sorted by IP."""
    if rows is None:
        import ray

        rows = ray.nodes()
    return sorted((n for n in parse_nodes(rows) if n.alive and n.ip), key=lambda n: n.ip)


def head_ip(nodes: Iterable[RayNode], address: Optional[str] = None) -> Optional[str]:
    """The head's IP: the node Ray marks as head, else (Ray 2.1.0) the host of the GCS address."""
    for n in nodes:
        if n.is_head:
            return n.ip
    gcs = None
    try:
        import ray

        gcs = ray.get_runtime_context().gcs_address
    except Exception:  # older Ray, or not connected: the address we were given
        gcs = address
    host = (gcs or "").rpartition(":")[0]
    return host or None


def logs_dir() -> str:
    """This process's Ray session log folder (it follows `ray start --temp-dir`), or Ray's default one
    when this process is not connected or its Ray does not say."""
    try:
        import ray

        node = getattr(ray._private.worker, "_global_node", None) or ray._private.worker.global_worker.node
        return node.get_logs_dir_path()
    except Exception:  # not connected, or an older/newer Ray without these internals
        return DEFAULT_LOGS_DIR


# ---- placement -----------------------------------------------------------------------------------
def pin_to_node(ip: str, fraction: float = PIN_FRACTION) -> Dict[str, Any]:
    """Options for `.options(**pin_to_node(ip))`: run on the node whose Ray IP is `ip`, nowhere else."""
    return {"resources": {"node:%s" % ip: fraction}}
