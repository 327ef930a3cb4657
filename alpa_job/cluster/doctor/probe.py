"""What runs ON each node, inside the doctor's probe actor: the node's facts, and its side of the port probe.

Phase 1 (target side): `Listeners` bind the node's own IP on the planned fixed ports nobody holds and on
sampled ports of every range, and report which ports are held by a listener (ours, or Ray's/sshd's).
Phase 2 (source side): `connect_all` connects to every other node's ports in parallel. Phase 3: the
listeners close (they also close themselves after a hold time, and with the actor).

Imports on the Alpa image's stack (Python 3.9, ray 2.1.0): standard library at module level.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

CONNECT_TIMEOUT_S = 1.0  # one TCP connect in the all-pairs probe
LISTEN_HOLD_S = 60.0  # phase-1 listeners close by themselves after this, whatever happens
SEARCH_SPAN = 64  # how far a sampled range port may move to find a free one


# ---- facts ---------------------------------------------------------------------------------------
def node_facts() -> Dict[str, Any]:
    """This node's addresses, hostname, versions, /dev/shm and GPUs (stdlib + ray only)."""
    import ray

    from alpa_job import versions
    from alpa_job.cluster.node_ip import local_ipv4_addresses

    return {
        "hostname": socket.gethostname(),
        "ray_ip": ray.util.get_node_ip_address(),
        "addresses": local_ipv4_addresses(),
        "versions": versions.collect(),
        "shm": shm_size(),
        "gpu": gpu_count(),
        "pid": os.getpid(),
    }


def shm_size(path: str = "/dev/shm") -> Dict[str, Any]:
    try:
        st = os.statvfs(path)
    except OSError as err:
        return {"bytes": None, "error": err.strerror or str(err)}
    return {"bytes": st.f_frsize * st.f_blocks, "free": st.f_frsize * st.f_bavail}


def gpu_count() -> Dict[str, Any]:
    """GPUs this host has: nvidia-smi -L when present, else CUDA_VISIBLE_DEVICES of the node."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=10)
        if out.returncode == 0:
            return {"count": sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")), "source": "nvidia-smi"}
    except (OSError, subprocess.SubprocessError):
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and visible.strip() not in ("", "-1", "NoDevFiles"):
        return {"count": len([d for d in visible.split(",") if d.strip()]), "source": "CUDA_VISIBLE_DEVICES"}
    return {"count": 0, "source": "no nvidia-smi"}


# ---- phase 1: listeners on the target ------------------------------------------------------------
class Listeners:
    """Phase 1 on a target node: hold listening sockets on its node IP for the sources to reach."""

    def __init__(self):
        self.socks: List[socket.socket] = []
        self.lock = threading.Lock()

    def open(
        self, node_ip: str, fixed: Sequence[Tuple[str, int]], ranges: Sequence[Tuple[str, int, int]], hold_s: float = LISTEN_HOLD_S
    ) -> List[Dict[str, Any]]:
        """[{name, port, listener: "ours"|"in use"|"none", error}] for the fixed ports and sampled ranges."""
        out = []
        for name, port in fixed:
            state, err = self._bind(node_ip, port)
            out.append({"name": name, "port": port, "listener": state, "error": err})
        for name, lo, hi in ranges:
            out.extend(self._sample_range(node_ip, name, lo, hi))
        timer = threading.Timer(hold_s, self.close)
        timer.daemon = True
        timer.start()
        return out

    def _sample_range(self, node_ip: str, name: str, lo: int, hi: int) -> List[Dict[str, Any]]:
        """Listen near the first, middle and last port of [lo, hi]: a taken port moves to the next free one."""
        seen, out = set(), []
        for start, step in ((lo, 1), ((lo + hi) // 2, 1), (hi, -1)):
            picked = None
            for port in range(start, start + step * SEARCH_SPAN, step):
                if not lo <= port <= hi or port in seen:
                    continue
                state, err = self._bind(node_ip, port)
                if state == "ours":
                    picked = {"name": name, "port": port, "listener": state, "error": None}
                    break
            if picked is None:  # every port near `start` is taken: probe `start` as it is
                picked = {"name": name, "port": start, "listener": "in use", "error": "no free port near it"}
            if picked["port"] not in seen:
                seen.add(picked["port"])
                out.append(picked)
        return out

    def _bind(self, ip: str, port: int) -> Tuple[str, Optional[str]]:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
            s.listen(64)
        except OSError as err:
            s.close()
            if err.errno == errno.EADDRINUSE:  # a listener (Ray's, sshd) holds it on this address
                return "in use", None
            # Unprivileged (the kit's images run Ray as uid 1000): a port below 1024 cannot be bound,
            # but a root daemon (sshd on 22) may already listen there: that listener is the target.
            if err.errno == errno.EACCES and connect_one(ip, port, 0.5)["status"] == "ok":
                return "in use", None
            return "none", errno.errorcode.get(err.errno or 0, str(err))
        with self.lock:
            self.socks.append(s)
        return "ours", None

    def close(self) -> int:
        with self.lock:
            socks, self.socks = self.socks, []
        for s in socks:
            s.close()
        return len(socks)


# ---- phase 2: connects from the source -----------------------------------------------------------
def connect_one(ip: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> Dict[str, Any]:
    """One TCP connect: ok, refused, timeout, unreachable (or the errno's name), and how long it took."""
    t0 = time.monotonic()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect((ip, port))
        status = "ok"
    except socket.timeout:
        status = "timeout"
    except OSError as err:
        status = {errno.ECONNREFUSED: "refused", errno.EHOSTUNREACH: "unreachable", errno.ENETUNREACH: "unreachable"}.get(
            err.errno, errno.errorcode.get(err.errno or 0, "error")
        )
    finally:
        s.close()
    return {"ip": ip, "port": port, "status": status, "seconds": round(time.monotonic() - t0, 3)}


def connect_all(targets: Sequence[Tuple[str, int]], timeout_s: float = CONNECT_TIMEOUT_S) -> List[Dict[str, Any]]:
    """Phase 2 on a source node: TCP connect to every (ip, port), in parallel."""
    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return list(pool.map(lambda t: connect_one(t[0], t[1], timeout_s), targets))


# ---- the actor -----------------------------------------------------------------------------------
class NodeProbe:
    """The probe actor's body (wrapped with ray.remote by the driver, pinned to one node)."""

    def __init__(self):
        self.listeners = Listeners()
        self.link_receiver = None

    # `doctor --network`: this node's side of the link probe (links.py)
    def link_listen(self, node_ip, port_range, hold_s):
        from alpa_job.cluster.doctor.links import LinkReceiver

        self.link_receiver = LinkReceiver(node_ip, tuple(port_range), hold_s)
        return self.link_receiver.port

    def link_send(self, src, dst, port, seconds, connect_timeout_s):
        from alpa_job.cluster.doctor.links import send_stream

        return send_stream(src, dst, port, seconds, connect_timeout_s)

    def route_to(self, dst):
        from alpa_job.cluster.doctor.links import route_to

        return route_to(dst)

    def link_received(self, peer):
        return self.link_receiver.take(peer) if self.link_receiver is not None else None

    def link_close(self):
        if self.link_receiver is not None:
            self.link_receiver.close()

    def facts(self) -> Dict[str, Any]:
        return node_facts()

    def listen(self, node_ip, fixed, ranges, hold_s=LISTEN_HOLD_S):
        return self.listeners.open(node_ip, fixed, ranges, hold_s)

    def connect(self, targets, timeout_s=CONNECT_TIMEOUT_S):
        return connect_all([tuple(t) for t in targets], timeout_s)

    def close(self) -> int:
        return self.listeners.close()
