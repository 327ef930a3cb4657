"""The all-pairs TCP reachability probe's plan and its results (pure: plain data in, plain data out).

Our firewall refuses with a TCP reset, which looks exactly like "nothing listens here" (ECONNREFUSED),
so refused-means-blocked only holds where something listens: every target first listens on its planned
ports (probe.Listeners), then every source connects to every other node's listened ports (head-only
ports only toward the head). A refusal or a timeout toward a port with a listener is a blocked port,
reported as source x target.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from alpa_job.cluster.doctor.checks import check

# Ray's own fixed ports: what a node whose probe actor never answered is still probed on.
RAY_FIXED_PORTS = ("node_manager", "object_manager", "gcs", "dashboard", "dashboard_agent_grpc")

Fixed = List[Tuple[str, int]]
Ranges = List[Tuple[str, int, int]]
Plan = Dict[str, List[Dict[str, Any]]]


def listen_plan(spec, skip: Iterable[str] = ()) -> Tuple[Dict[str, Fixed], Ranges]:
    """({role: [(name, port)]} of the fixed ports, [(name, lo, hi)] of the ranges), `skip` names left out."""
    skip = set(skip)
    fixed_by_role = {
        role: [(s.name, s.lo) for s in spec.member_tcp_ports(role) if not s.is_range and s.name not in skip] for role in ("head", "worker")
    }
    ranges = [(s.name, s.lo, s.hi) for s in spec.member_tcp_ports("worker") if s.is_range and s.name not in skip]
    return fixed_by_role, ranges


def role_of(ip: str, head: Optional[str]) -> str:
    return "head" if ip == head else "worker"


def target_plan(
    nodes: Iterable[str], listening: Mapping[str, List[Dict[str, Any]]], fixed_by_role: Mapping[str, Fixed], head: Optional[str]
) -> Tuple[Plan, List[Dict[str, Any]]]:
    """What to probe on each target: its listened ports; a node that opened no listeners only on Ray's
    fixed ports. Also the checks for ports a node could not listen on."""
    plan: Plan = {}
    checks = []
    for ip in nodes:
        if ip not in listening:
            plan[ip] = [{"name": n, "port": p, "listener": "ray"} for n, p in fixed_by_role[role_of(ip, head)] if n in RAY_FIXED_PORTS]
            continue
        plan[ip] = [p for p in listening[ip] if p["listener"] in ("ours", "in use")]
        for p in listening[ip]:
            if p["listener"] == "none":
                checks.append(
                    check(
                        "ports",
                        ip,
                        False,
                        "cannot listen on %s:%d (%s) for the probe: %s" % (ip, p["port"], p["name"], p["error"]),
                        "check that %s is this host's address" % ip,
                    )
                )
    return plan, checks


def connect_targets(src: str, plan: Mapping[str, List[Dict[str, Any]]]) -> List[Tuple[str, int]]:
    """Every (ip, port) `src` connects to: each other node's planned ports."""
    return [(dst, p["port"]) for dst in sorted(plan) if dst != src for p in plan[dst]]


Blocked = Dict[Tuple[str, str], Dict[int, List[str]]]  # (target, port name) -> {port: ["source (status)"]}


def build_matrix(
    nodes: Sequence[str], plan: Mapping[str, List[Dict[str, Any]]], connected: Mapping[str, List[Dict[str, Any]]]
) -> Tuple[Dict[str, Dict[str, Any]], Blocked]:
    """{source: {target: {ok, probed, blocked}}} (ok None: the source never reported) and the blocked ports."""
    names = {(dst, p["port"]): p["name"] for dst in plan for p in plan[dst]}
    matrix: Dict[str, Dict[str, Any]] = {}
    blocked: Blocked = {}
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
            row[dst] = {
                "ok": not bad,
                "probed": len(res),
                "blocked": ["%d %s (%s)" % (r["port"], names.get((dst, r["port"]), "?"), r["status"]) for r in bad],
            }
            for r in bad:
                blocked.setdefault((dst, names.get((dst, r["port"]), "?")), {}).setdefault(r["port"], []).append(
                    "%s (%s)" % (src, r["status"])
                )
        matrix[src] = row
    return matrix, blocked


def blocked_checks(spec, blocked: Blocked) -> List[Dict[str, Any]]:
    """One failed check per (target, port name): the ports, the sources that could not reach them, the fix."""
    out = []
    for (dst, name), by_port in sorted(blocked.items()):
        span = spec.span(name) if name != "?" else None
        srcs = sorted({src for froms in by_port.values() for src in froms})
        ports = ", ".join(str(p) for p in sorted(by_port))
        what = "TCP %s (%s%s)" % (ports, name, " range %s" % span.text() if span is not None and span.is_range else "")
        out.append(
            check(
                "ports",
                dst,
                False,
                "%s blocked from %s" % (what, ", ".join(srcs)),
                "open TCP %s (%s) on %s to every cluster member: load the rules of python -m alpa_job.cluster.firewall "
                "(the ports in the cluster spec)" % (span.text() if span is not None else ports, name, dst),
            )
        )
    return out


def all_connected_check(connected: Mapping[str, List[Dict[str, Any]]], node_count: int) -> Dict[str, Any]:
    total = sum(len(v) for v in connected.values())
    return check("ports", None, True, "%d TCP probes between %d nodes all connected" % (total, node_count))
