"""`python -m alpa_job doctor`: check a RUNNING cluster the way jobs will use it.

A green `ray status` proves nothing behind a firewall (a node whose node-manager port is blocked
joins, looks alive, and hangs every task pinned to it). So the doctor

1. connects with a timeout (an unreachable head fails in seconds, naming the address and the fix);
2. starts one small probe actor pinned to EACH alive node (`resources={"node:<ip>": 0.001}`,
   num_cpus=0) with a per-node timeout: a node whose probe does not answer is a failure;
3. checks, per node, that Ray's IP is an address of that host AND lies in the spec's cluster_cidr;
   /dev/shm size; GPUs (nvidia-smi vs Ray's GPU resource); and that versions are equal everywhere;
4. probes TCP all-pairs in two phases. Our firewall refuses with a TCP reset, which looks exactly
   like "nothing listens here" (ECONNREFUSED), so refused-means-blocked only holds where something
   listens. Phase 1: every node binds its own node IP on the planned fixed ports nobody holds
   (ssh without sshd, ...) and on sampled ports of every range (near the first, middle and last
   port; a port already taken moves to the next free one), and reports which ports are held by a
   listener (ours or Ray's). Phase 2: every node connects to every other node's ports (head-only
   ports only toward the head). Phase 3: the listeners close (they also close themselves after a
   hold time, and with the actor). A refusal or a timeout toward a port that has a listener is a
   blocked port, reported as source x target.

Every wait has a timeout, bounded by `--deadline`; on the deadline the doctor reports what it knows
and fails. Exit 0 when every check passes, 3 (EXIT_CHECK_FAILED) otherwise.

This module imports on the Alpa image's stack too (Python 3.9, ray 2.1.0): only the standard library
at module level; ray and the spec's yaml are imported when the doctor runs.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from alpa_job.cluster.worker_path import worker_pythonpath
from alpa_job.errors import EXIT_CHECK_FAILED, EXIT_OK, EXIT_TIMEOUT, KitError

DEFAULT_DEADLINE_S = 60.0
NODE_TIMEOUT_S = 10.0  # a probe pinned to a node must answer within this
CONNECT_TIMEOUT_S = 1.0  # one TCP connect in the all-pairs probe
HEAD_CONNECT_TIMEOUT_S = 5.0  # the first TCP check of the GCS address
LISTEN_HOLD_S = 60.0  # phase-1 listeners close by themselves after this, whatever happens
SHM_MIN_BYTES = 1 << 30  # NCCL (and Ray's plasma store) need /dev/shm; Docker's default is 64 MiB
# Compared on every node. cuda/nccl only among nodes that have them (a CPU-only head has neither).
VERSION_KEYS = ("python", "jax", "jaxlib", "ray", "alpa", "cuda", "nccl")
OPTIONAL_VERSION_KEYS = ("cuda", "nccl")
SEARCH_SPAN = 64  # how far a sampled range port may move to find a free one


# ---- checks: plain data ------------------------------------------------------------------------
def check(name: str, node: Optional[str], ok: bool, detail: str, fix: str = "", warn: bool = False) -> Dict[str, Any]:
    """One line of the doctor's verdict. `warn`: passes, but worth reading."""
    return {"name": name, "node": node, "ok": bool(ok), "warn": bool(warn and ok), "detail": detail, "fix": fix}


def check_node_ip(node: str, ray_ip: str, addresses: Mapping[str, Sequence[str]], cidr: str) -> List[Dict[str, Any]]:
    """Ray's IP of a node must be one of that host's addresses and lie in the cluster CIDR."""
    import ipaddress

    mine = sorted({ip for ips in addresses.values() for ip in ips})
    in_cidr = [ip for ip in mine if ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)]
    hint = in_cidr[0] if len(in_cidr) == 1 else "<its address in %s>" % cidr
    if ray_ip not in mine:
        return [check("node_ip", node, False,
                      "Ray IP %s is not an address of this host (its addresses: %s)" % (ray_ip, ", ".join(mine) or "none"),
                      "restart it with --node-ip-address=%s" % hint)]
    if ipaddress.ip_address(ray_ip) not in ipaddress.ip_network(cidr):
        return [check("node_ip", node, False,
                      "Ray IP %s is not in cluster CIDR %s (its addresses: %s)" % (ray_ip, cidr, ", ".join(mine)),
                      "restart it with --node-ip-address=%s (python -m alpa_job.cluster.node_ip prints it)" % hint)]
    return [check("node_ip", node, True, "Ray IP %s is this host's address in %s" % (ray_ip, cidr))]


def compare_versions(per_node: Mapping[str, Mapping[str, Optional[str]]],
                     prefer: Optional[str] = None) -> List[Dict[str, Any]]:
    """One check per package in VERSION_KEYS: equal on every node, else name the odd node(s).

    The reference value is the most common one (ties: `prefer`'s, i.e. the head's). A package missing
    on some nodes only is a skew too, except cuda/nccl, compared among the nodes that have them.
    """
    out = []
    for key in VERSION_KEYS:
        values = {node: (v or {}).get(key) for node, v in per_node.items()}
        if key in OPTIONAL_VERSION_KEYS:
            values = {n: v for n, v in values.items() if v is not None}
        if not values or all(v is None for v in values.values()):
            continue
        counts = Counter(values.values())
        best = max(counts.values())
        tied = [v for v, c in counts.items() if c == best]
        ref = values[prefer] if prefer in values and values[prefer] in tied else sorted(tied, key=str)[0]
        odd = sorted(n for n, v in values.items() if v != ref)
        if not odd:
            out.append(check("versions", None, True, "%s %s on every node" % (key, ref)))
            continue
        for node in odd:
            out.append(check(
                "versions", node, False,
                "%s %s here, %s on %s" % (key, values[node] or "missing", ref or "missing",
                                          ", ".join(n for n in sorted(values) if values[n] == ref)),
                "install %s %s on %s (one image for every node)" % (key, ref, node) if ref else
                "remove %s from %s or install it everywhere (one image for every node)" % (key, node)))
    return out


def check_shm(node: str, shm: Mapping[str, Any], gpus: int) -> Dict[str, Any]:
    size = shm.get("bytes")
    if size is None:
        return check("shm", node, gpus == 0, "/dev/shm missing (%s)" % shm.get("error", "?"),
                     "mount a tmpfs on /dev/shm (docker --shm-size=8g or --ipc=host)", warn=True)
    text = "/dev/shm %s" % _gib(size)
    if size >= SHM_MIN_BYTES:
        return check("shm", node, True, text)
    # NCCL fails with "posix_fallocate ... No space left" on a small /dev/shm: fatal with GPUs.
    return check("shm", node, gpus == 0, "%s, below %s%s" % (text, _gib(SHM_MIN_BYTES),
                 "" if gpus else " (no GPUs here: Ray's object store falls back to disk)"),
                 "give the node a larger /dev/shm (docker --shm-size=8g or --ipc=host)", warn=True)


def check_gpus(node: str, gpu: Mapping[str, Any], ray_gpus: float) -> Dict[str, Any]:
    seen = gpu.get("count")
    text = "%s GPU(s) by %s, Ray resource GPU=%g" % (seen if seen is not None else "?", gpu.get("source"), ray_gpus)
    if seen and int(ray_gpus) != seen:
        return check("gpus", node, False, text, "restart Ray on %s with --num-gpus=%d" % (node, seen))
    return check("gpus", node, True, text)


def _gib(n: float) -> str:
    return "%.1f GiB" % (n / float(1 << 30)) if n >= (1 << 30) else "%d MiB" % (n // (1 << 20))


# ---- what runs ON each node (inside the probe actor) -------------------------------------------
def node_facts() -> Dict[str, Any]:
    """This node's addresses, hostname, versions, /dev/shm and GPUs (stdlib + ray only)."""
    import ray

    from alpa_job import versions
    from alpa_job.cluster.node_ip import local_ipv4_addresses

    return {"hostname": socket.gethostname(), "ray_ip": ray.util.get_node_ip_address(),
            "addresses": local_ipv4_addresses(), "versions": versions.collect(), "shm": shm_size(),
            "gpu": gpu_count(), "pid": os.getpid()}


def shm_size(path: str = "/dev/shm") -> Dict[str, Any]:
    try:
        st = os.statvfs(path)
    except OSError as err:
        return {"bytes": None, "error": err.strerror or str(err)}
    return {"bytes": st.f_frsize * st.f_blocks, "free": st.f_frsize * st.f_bavail}


def gpu_count() -> Dict[str, Any]:
    """GPUs this host has: nvidia-smi -L when present, else CUDA_VISIBLE_DEVICES of the node."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             universal_newlines=True, timeout=10)
        if out.returncode == 0:
            return {"count": sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")),
                    "source": "nvidia-smi"}
    except (OSError, subprocess.SubprocessError):
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and visible.strip() not in ("", "-1", "NoDevFiles"):
        return {"count": len([d for d in visible.split(",") if d.strip()]), "source": "CUDA_VISIBLE_DEVICES"}
    return {"count": 0, "source": "no nvidia-smi"}


class Listeners:
    """Phase 1 on a target node: hold listening sockets on its node IP for the sources to reach."""

    def __init__(self):
        self.socks: List[socket.socket] = []
        self.lock = threading.Lock()

    def open(self, node_ip: str, fixed: Sequence[Tuple[str, int]], ranges: Sequence[Tuple[str, int, int]],
             hold_s: float = LISTEN_HOLD_S) -> List[Dict[str, Any]]:
        """[{name, port, listener: "ours"|"in use"|"none", error}] for the fixed ports and sampled ranges."""
        out = []
        for name, port in fixed:
            state, err = self._bind(node_ip, port)
            out.append({"name": name, "port": port, "listener": state, "error": err})
        for name, lo, hi in ranges:
            seen = set()
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
        timer = threading.Timer(hold_s, self.close)
        timer.daemon = True
        timer.start()
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


def connect_all(targets: Sequence[Tuple[str, int]], timeout_s: float = CONNECT_TIMEOUT_S) -> List[Dict[str, Any]]:
    """Phase 2 on a source node: TCP connect to every (ip, port), in parallel."""
    def one(target):
        ip, port = target
        t0 = time.monotonic()
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        try:
            s.connect((ip, port))
            status = "ok"
        except socket.timeout:
            status = "timeout"
        except OSError as err:
            status = {errno.ECONNREFUSED: "refused", errno.EHOSTUNREACH: "unreachable",
                      errno.ENETUNREACH: "unreachable"}.get(err.errno, errno.errorcode.get(err.errno or 0, "error"))
        finally:
            s.close()
        return {"ip": ip, "port": port, "status": status, "seconds": round(time.monotonic() - t0, 3)}

    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return list(pool.map(one, targets))


class NodeProbe:
    """The probe actor's body (wrapped with ray.remote by the driver)."""

    def __init__(self):
        self.listeners = Listeners()

    def facts(self) -> Dict[str, Any]:
        return node_facts()

    def listen(self, node_ip, fixed, ranges, hold_s=LISTEN_HOLD_S):
        return self.listeners.open(node_ip, fixed, ranges, hold_s)

    def connect(self, targets, timeout_s=CONNECT_TIMEOUT_S):
        return connect_all([tuple(t) for t in targets], timeout_s)

    def close(self) -> int:
        return self.listeners.close()


# ---- the driver ----------------------------------------------------------------------------------
class Deadline:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self, cap: Optional[float] = None) -> float:
        left = max(0.0, self.end - time.monotonic())
        return left if cap is None else min(cap, left)

    @property
    def passed(self) -> bool:
        return self.left() <= 0


def _head_ip(ray, address: str, nodes: Sequence[Mapping[str, Any]]) -> Optional[str]:
    for n in nodes:
        if "node:__internal_head__" in (n.get("Resources") or {}):  # Ray >= ~2.5
            return n["NodeManagerAddress"]
    gcs = None
    try:
        gcs = ray.get_runtime_context().gcs_address
    except Exception:  # older Ray: fall back to the address we were given
        gcs = address
    host = (gcs or "").rpartition(":")[0]
    return host or None


def _wait(ray, refs: Mapping[str, Any], timeout_s: float) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """{key: value} of the refs done within timeout_s, and {key: error} of the others."""
    by_ref = {ref: key for key, ref in refs.items()}
    ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=max(0.0, timeout_s))
    done, failed = {}, {}
    for ref in ready:
        key = by_ref[ref]
        try:
            done[key] = ray.get(ref, timeout=max(1.0, timeout_s))
        except Exception as err:  # a probe that raised: keep its first line
            failed[key] = "%s: %s" % (type(err).__name__, (str(err).strip().splitlines() or [""])[-1][:300])
    for ref, key in by_ref.items():
        if key not in done and key not in failed:
            failed[key] = "timeout"
    return done, failed


def run_doctor(address: str, spec, deadline_s: float = DEFAULT_DEADLINE_S,
               node_timeout_s: float = NODE_TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S,
               skip_ports: Sequence[str] = ()) -> Dict[str, Any]:
    """Run every check against the cluster at `address`; returns the JSON-ready result.

    `skip_ports`: names of planned ports/ranges not to probe (e.g. "ssh" on Kubernetes: pods run no sshd
    and k8s/networkpolicy.yaml does not open it).
    """
    unknown = sorted(set(skip_ports) - set(spec.ports) - set(spec.ranges))
    if unknown:
        raise KitError("--skip-ports names %s, not in the cluster spec; use names from: %s"
                       % (", ".join(unknown), ", ".join(list(spec.ports) + list(spec.ranges))))
    t0 = time.monotonic()
    deadline = Deadline(deadline_s)
    checks: List[Dict[str, Any]] = []
    result: Dict[str, Any] = {"address": address, "cluster_cidr": spec.cluster_cidr, "spec": spec.source,
                              "checks": checks, "nodes": {}, "matrix": {}, "skipped_ports": sorted(set(skip_ports))}

    if address not in ("auto",) and not address.startswith(("ray://", "http://", "https://")):
        from alpa_job.cluster.connect import check_reachable

        check_reachable(address, timeout_s=deadline.left(HEAD_CONNECT_TIMEOUT_S) or 0.1)
    elif address.startswith(("http://", "https://")):
        raise KitError("--address %s is the dashboard URL; pass the GCS address HOST:%d (or run on a node with "
                       "--address auto)" % (address, spec.ports["gcs"]))
    import logging

    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR, ignore_reinit_error=True)
    except ConnectionError as err:
        raise KitError("cannot join Ray at %s (%s); start the head (ray start --head) or fix --address"
                       % (address, (str(err).splitlines() or [""])[0]), EXIT_TIMEOUT) from None
    try:
        _run(ray, address, spec, deadline, node_timeout_s, connect_timeout_s, result)
    finally:
        result["seconds"] = round(time.monotonic() - t0, 2)
        result["ok"] = all(c["ok"] for c in checks)
    return result


def _run(ray, address, spec, deadline, node_timeout_s, connect_timeout_s, result) -> None:
    checks = result["checks"]
    all_nodes = ray.nodes()
    nodes = {n["NodeManagerAddress"]: n for n in all_nodes if n.get("Alive")}
    head = _head_ip(ray, address, list(nodes.values()))
    result["head"] = head
    if not nodes:
        checks.append(check("nodes", None, False, "no alive Ray node", "start the head and workers (ray start)"))
        return
    dead = sorted({n["NodeManagerAddress"] for n in all_nodes if not n.get("Alive")} - set(nodes))
    checks.append(check("nodes", None, True, "%d alive node(s): %s%s" % (
        len(nodes), ", ".join(sorted(nodes)), "; dead earlier: %s" % ", ".join(dead) if dead else ""), warn=bool(dead)))

    Probe = ray.remote(num_cpus=0)(NodeProbe)
    # Keeps the node's own PYTHONPATH visible to the probe (worker_path explains why).
    env = {"PYTHONPATH": worker_pythonpath()}
    actors = {ip: Probe.options(resources={"node:%s" % ip: 0.001}, runtime_env={"env_vars": env}).remote()
              for ip in nodes}
    try:
        _probe(ray, spec, deadline, node_timeout_s, connect_timeout_s, result, nodes, head, actors)
    finally:
        for actor in actors.values():
            try:
                ray.kill(actor)
            except Exception:
                pass


def _deadline_check(deadline, what: str) -> Dict[str, Any]:
    return check("deadline", None, False, "the %.0f s deadline passed %s; the checks above are what is known"
                 % (deadline.seconds, what), "raise --deadline, or fix the nodes named above")


def _probe(ray, spec, deadline, node_timeout_s, connect_timeout_s, result, nodes, head, actors) -> None:
    checks = result["checks"]
    nm_port = spec.ports["node_manager"]
    # 1. a probe pinned to every node: facts
    timeout = deadline.left(node_timeout_s)
    facts, failed = _wait(ray, {ip: a.facts.remote() for ip, a in actors.items()}, timeout)
    for ip in sorted(failed):
        if failed[ip] == "timeout":
            detail = ("a task pinned to it did not finish in %.0f s; its node-manager port %d is probably blocked"
                      % (timeout, nm_port))
        else:
            detail = "a task pinned to it failed: %s" % failed[ip]
        checks.append(check("tasks", ip, False, detail, "open the ports in the cluster spec (python -m "
                            "alpa_job.cluster.firewall) and check its Ray logs under /tmp/ray/session_latest/logs"))
    for ip in sorted(facts):
        f = facts[ip]
        result["nodes"][ip] = {"hostname": f["hostname"], "addresses": f["addresses"], "versions": f["versions"],
                               "shm_bytes": f["shm"].get("bytes"), "gpus": f["gpu"].get("count"),
                               "gpu_source": f["gpu"].get("source"), "head": ip == head,
                               "ray_gpus": (nodes[ip].get("Resources") or {}).get("GPU", 0)}
        checks.append(check("tasks", ip, True, "a pinned task ran on %s (%s)" % (ip, f["hostname"])))
        checks.extend(check_node_ip(ip, ip, f["addresses"], spec.cluster_cidr))
        if f["ray_ip"] != ip:
            checks.append(check("node_ip", ip, False, "a task on node %s sees Ray IP %s" % (ip, f["ray_ip"]),
                                "restart it with --node-ip-address=<its address in %s>" % spec.cluster_cidr))
        checks.append(check_shm(ip, f["shm"], f["gpu"].get("count") or 0))
        checks.append(check_gpus(ip, f["gpu"], (nodes[ip].get("Resources") or {}).get("GPU", 0)))
    if len(facts) > 1:
        checks.extend(compare_versions({ip: f["versions"] for ip, f in facts.items()}, prefer=head))
    if deadline.passed:
        checks.append(_deadline_check(deadline, "after the per-node probe"))
        return

    # 2. ports, all pairs. Phase 1: listeners on every responsive node.
    fixed_by_role = {}
    ranges = []
    skip = set(result.get("skipped_ports") or ())
    for role in ("head", "worker"):
        fixed_by_role[role] = [(s.name, s.lo) for s in spec.member_tcp_ports(role)
                               if not s.is_range and s.name not in skip]
    ranges = [(s.name, s.lo, s.hi) for s in spec.member_tcp_ports("worker") if s.is_range and s.name not in skip]
    listen_refs = {ip: actors[ip].listen.remote(ip, fixed_by_role["head" if ip == head else "worker"], ranges,
                                                LISTEN_HOLD_S)
                   for ip in facts}
    listening, lfailed = _wait(ray, listen_refs, deadline.left(node_timeout_s))
    for ip, why in sorted(lfailed.items()):
        checks.append(check("ports", ip, False, "could not open probe listeners: %s" % why,
                            "check the node's Ray logs"))
    # What to probe on each target: its listened ports; unresponsive nodes only on Ray's fixed ports.
    plan: Dict[str, List[Dict[str, Any]]] = {}
    for ip in nodes:
        if ip in listening:
            plan[ip] = [p for p in listening[ip] if p["listener"] in ("ours", "in use")]
            for p in listening[ip]:
                if p["listener"] == "none":
                    checks.append(check("ports", ip, False, "cannot listen on %s:%d (%s) for the probe: %s"
                                        % (ip, p["port"], p["name"], p["error"]),
                                        "check that %s is this host's address" % ip))
        else:
            plan[ip] = [{"name": n, "port": p, "listener": "ray"}
                        for n, p in fixed_by_role["head" if ip == head else "worker"]
                        if n in ("node_manager", "object_manager", "gcs", "dashboard", "dashboard_agent_grpc")]
    result["probed_ports"] = {ip: ["%d %s" % (p["port"], p["name"]) for p in plan[ip]] for ip in plan}
    # Phase 2: every responsive node connects to every other node.
    sources = [ip for ip in nodes if ip in listening or ip in facts]
    conn_refs = {}
    for src in sources:
        targets = [(dst, p["port"]) for dst in sorted(nodes) if dst != src for p in plan[dst]]
        conn_refs[src] = actors[src].connect.remote(targets, connect_timeout_s)
    need = connect_timeout_s * 4 + 5  # parallel connects: a few rounds of timeouts at most
    connected, cfailed = _wait(ray, conn_refs, deadline.left(max(need, node_timeout_s)))
    # Phase 3: close the listeners (they also close themselves after LISTEN_HOLD_S).
    try:
        ray.get([actors[ip].close.remote() for ip in listening], timeout=deadline.left(5.0) or 0.1)
    except Exception:
        pass
    for src, why in sorted(cfailed.items()):
        checks.append(check("ports", src, False, "the connect probe from %s did not finish: %s" % (src, why),
                            "check the node's Ray logs"))
    names = {(dst, p["port"]): p["name"] for dst in plan for p in plan[dst]}
    matrix = {}
    blocked_by_target: Dict[Tuple[str, str], Dict[int, List[str]]] = {}
    for src in sorted(nodes):
        row = {}
        for dst in sorted(nodes):
            if dst == src:
                continue
            if src not in connected:
                row[dst] = {"ok": None, "blocked": [], "probed": 0}
                continue
            res = [r for r in connected[src] if r["ip"] == dst]
            bad = [r for r in res if r["status"] != "ok"]
            row[dst] = {"ok": not bad, "probed": len(res),
                        "blocked": ["%d %s (%s)" % (r["port"], names.get((dst, r["port"]), "?"), r["status"]) for r in bad]}
            for r in bad:
                name = names.get((dst, r["port"]), "?")
                blocked_by_target.setdefault((dst, name), {}).setdefault(r["port"], []).append(
                    "%s (%s)" % (src, r["status"]))
        matrix[src] = row
    result["matrix"] = matrix
    for (dst, name), by_port in sorted(blocked_by_target.items()):
        span = spec.span(name) if name != "?" else None
        srcs = sorted({src for froms in by_port.values() for src in froms})
        ports = ", ".join(str(p) for p in sorted(by_port))
        what = "TCP %s (%s%s)" % (ports, name, " range %s" % span.text() if span is not None and span.is_range else "")
        checks.append(check(
            "ports", dst, False, "%s blocked from %s" % (what, ", ".join(srcs)),
            "open TCP %s (%s) on %s to every cluster member: load the rules of python -m alpa_job.cluster.firewall "
            "(the ports in the cluster spec)" % (span.text() if span is not None else ports, name, dst)))
    if not blocked_by_target and connected and len(nodes) > 1:
        total = sum(len(v) for v in connected.values())
        checks.append(check("ports", None, True, "%d TCP probes between %d nodes all connected"
                            % (total, len(nodes))))
    if deadline.passed:
        checks.append(_deadline_check(deadline, "during the port probe"))


# ---- output ------------------------------------------------------------------------------------------
def render_table(result: Mapping[str, Any]) -> str:
    lines = []
    nodes = result.get("nodes", {})
    lines.append("doctor: %s (cidr %s, head %s) in %.1f s: %s" % (
        result.get("address"), result.get("cluster_cidr"), result.get("head"), result.get("seconds", 0),
        "OK" if result.get("ok") else "FAILED"))
    if nodes:
        lines.append("")
        header = ("node", "host", "shm", "gpus", "python", "ray", "jax", "jaxlib", "alpa")
        rows = []
        for ip in sorted(nodes):
            n = nodes[ip]
            v = n.get("versions") or {}
            rows.append((ip + (" (head)" if n.get("head") else ""), n.get("hostname") or "",
                         _gib(n["shm_bytes"]) if n.get("shm_bytes") else "-", str(n.get("gpus")),
                         *(str(v.get(k) or "-") for k in ("python", "ray", "jax", "jaxlib", "alpa"))))
        lines += _grid(header, rows)
    matrix = result.get("matrix") or {}
    if matrix:
        lines.append("")
        lines.append("TCP reachability (row: source, column: target)")
        ips = sorted(set(matrix) | {d for row in matrix.values() for d in row})
        rows = []
        for src in ips:
            cells = []
            for dst in ips:
                if dst == src:
                    cells.append("-")
                    continue
                cell = matrix.get(src, {}).get(dst)
                if cell is None or cell.get("ok") is None:
                    cells.append("?")
                else:
                    cells.append("ok" if cell["ok"] else "blocked: " + ", ".join(cell["blocked"]))
            rows.append((src,) + tuple(cells))
        lines += _grid(("source \\ target",) + tuple(ips), rows)
    lines.append("")
    for c in result.get("checks", []):
        mark = "ok  " if c["ok"] and not c.get("warn") else ("warn" if c["ok"] else "FAIL")
        lines.append("%s %-9s %-12s %s%s" % (mark, c["name"], c["node"] or "*", c["detail"],
                                              "  -> fix: " + c["fix"] if not c["ok"] or c.get("warn") else ""))
    return "\n".join(lines)


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    widths = [max(len(str(r[i])) for r in [header] + list(rows)) for i in range(len(header))]
    fmt = "  ".join("%%-%ds" % w for w in widths)
    return [fmt % tuple(header), fmt % tuple("-" * w for w in widths)] + [fmt % tuple(r) for r in rows]


def main(args) -> int:
    """CLI entry (alpa_job.cli dispatches here): exit 0 all ok, 3 on a failed check."""
    from alpa_job.cluster.spec import load_spec

    spec = load_spec(getattr(args, "cluster_spec", None))
    address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS") or "auto"
    deadline = float(getattr(args, "deadline", None) or DEFAULT_DEADLINE_S)
    node_timeout = float(getattr(args, "node_timeout", None) or NODE_TIMEOUT_S)
    skip = [n.strip() for n in (getattr(args, "skip_ports", None) or "").split(",") if n.strip()]
    result = run_doctor(address, spec, deadline_s=deadline, node_timeout_s=node_timeout, skip_ports=skip)
    if getattr(args, "format", "table") == "json":
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        print(render_table(result))
    if not result["ok"]:
        failed = [c for c in result["checks"] if not c["ok"]]
        first = failed[0]
        print("doctor: %d check(s) failed; first: %s%s -> fix: %s" % (
            len(failed), "node %s: " % first["node"] if first["node"] else "", first["detail"], first["fix"]),
            file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK
