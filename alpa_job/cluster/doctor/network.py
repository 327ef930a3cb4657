"""`doctor --network`: every pair of nodes measures the link between them, both ways, on the path training
traffic takes (a port of the cluster's ephemeral range, from each node's own cluster address), and the
verdicts name the slow host or link.

The pairs run in rounds where no node is in two pairs (a round-robin schedule: N - 1 rounds for N nodes),
so a link is measured alone and a round takes one stream's time: 8 nodes in 7 rounds of about two seconds.
A link is slow below a quarter of the median of all the links measured, or of what the cluster spec declares
(`network.gbps`), and still slow when it streams again alone; a host whose every link one way is slow is
named once, as the cause.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from alpa_job.cluster.doctor.checks import check

STREAM_S = 1.0  # one direction's bulk stream
# Slower than this share of the reference is a slow link: a misconfigured link (a 1 Gb/s port among 10s and
# 100s, sockets where RDMA was meant) is many times slower, while busy nodes move a healthy link's figure by
# a factor of two.
SLOW_FRACTION = 0.25
ROUND_SLACK_S = 15.0  # a round's streams (and their buffered tail on a slow link) end within this
MIN_LINKS_FOR_MEDIAN = 3  # fewer measured links give no median to compare against


def round_robin(nodes: Sequence[str]) -> List[List[Tuple[str, str]]]:
    """Rounds of disjoint pairs covering every pair once (the circle method; a bye for an odd count)."""
    ring: List[Optional[str]] = list(nodes) + ([None] if len(nodes) % 2 else [])
    n = len(ring)
    rounds = []
    for _ in range(n - 1):
        pairs = [(ring[i], ring[n - 1 - i]) for i in range(n // 2)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        ring = [ring[0], ring[-1]] + ring[1:-1]
    return [r for r in rounds if r]


def link_row(
    src: str, dst: str, sent: Optional[Mapping[str, Any]], received: Optional[Mapping[str, Any]], failure: Optional[str]
) -> Dict[str, Any]:
    """One direction's figures: Gb/s by the receiver's clock, the sender's latency; or its error."""
    row: Dict[str, Any] = {"src": src, "dst": dst, "gbps": None, "rtt_ms": None, "error": None}
    if failure or sent is None:
        row["error"] = failure or "no answer"
        return row
    row["rtt_ms"] = sent.get("rtt_ms")
    if sent.get("error"):
        row["error"] = sent["error"]
    elif not received or received.get("error") or not received.get("seconds"):
        row["error"] = "the receiver timed no stream" + (": %s" % received["error"] if received and received.get("error") else "")
    else:
        row.update(bytes=received["bytes"], seconds=received["seconds"], gbps=round(received["bytes"] * 8 / received["seconds"] / 1e9, 4))
    return row


def measure(
    ray, actors: Mapping[str, Any], spec, deadline, connect_timeout_s: float, node_timeout_s: float, wait_refs
) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(a row per directed link, checks for nodes that could not take part) over the pinned probe actors."""
    nodes = sorted(actors)
    lo, hi = spec.ranges["ephemeral"]
    hold = deadline.left() + 5
    ports, failed = wait_refs(ray, {ip: actors[ip].link_listen.remote(ip, (lo, hi), hold) for ip in nodes}, deadline.left(node_timeout_s))
    checks = [
        check(
            "network",
            ip,
            False,
            "could not listen for the link probe: %s" % why,
            "free a port in the ephemeral range %d-%d on %s" % (lo, hi, ip),
        )
        for ip, why in sorted(failed.items())
    ]

    def streams(directed: Sequence[Tuple[str, str]]) -> List[Dict[str, Any]]:
        """These directed links' streams at once (no node sends twice, nor receives twice)."""
        keys = {"%s>%s" % (s, d): (s, d) for s, d in directed}
        sent, send_failed = wait_refs(
            ray,
            {k: actors[s].link_send.remote(s, d, ports[d], STREAM_S, connect_timeout_s) for k, (s, d) in keys.items()},
            deadline.left(STREAM_S + ROUND_SLACK_S),
        )
        received, _ = wait_refs(ray, {k: actors[d].link_received.remote(s) for k, (s, d) in keys.items()}, deadline.left(node_timeout_s))
        return [link_row(s, d, sent.get(k), received.get(k), send_failed.get(k)) for k, (s, d) in keys.items()]

    rows: List[Dict[str, Any]] = []
    for pairs in round_robin([ip for ip in nodes if ip in ports]):
        if deadline.passed:
            break
        rows += streams([(a, b) for a, b in pairs] + [(b, a) for a, b in pairs])
    # A link that looked slow streams again, alone: a busy moment on a node (another job, a compile) must not
    # be named as a slow link; a link that is slow stays slow. The better of the two counts.
    for i, row in enumerate(rows):
        if row in suspects(rows, spec.network.gbps) and not deadline.passed:
            again = streams([(row["src"], row["dst"])])[0]
            if (again["gbps"] or 0) > (row["gbps"] or 0):
                rows[i] = dict(again, remeasured=True)
    for ip in ports:
        actors[ip].link_close.remote()
    return rows, checks


def route_checks(routes: Mapping[str, Mapping[str, Any]], ray_ifaces: Mapping[str, Optional[str]], head: str) -> List[Dict[str, Any]]:
    """A node whose route to the head leaves from another address than its Ray address: Ray and the traffic
    it starts take different interfaces (the head sees the wrong source, a firewall drops it, or the
    training traffic takes the slow network)."""
    out = []
    for ip in sorted(routes):
        route = routes[ip]
        if route.get("error") or not route.get("source") or route["source"] == ip:
            continue
        out.append(
            check(
                "network",
                ip,
                False,
                "Ray is bound to %s (%s) on %s, but the route to the head %s leaves "
                "from %s (%s)" % (ip, ray_ifaces.get(ip) or "?", ip, head, route["source"], route.get("iface") or "?"),
                "route the cluster CIDR through %s on that node (ip route), or restart its Ray with "
                "--node-ip-address %s" % (ray_ifaces.get(ip) or "Ray's interface", route["source"]),
            )
        )
    return out


def suspects(rows: Sequence[Mapping[str, Any]], declared: float = 0.0) -> List[Mapping[str, Any]]:
    """Measured links below SLOW_FRACTION of the median of all of them, or of the declared bandwidth."""
    measured = [r for r in rows if r["gbps"] is not None]
    median = statistics.median([r["gbps"] for r in measured]) if len(measured) >= MIN_LINKS_FOR_MEDIAN else None
    refs = [x for x in (median, declared or None) if x]
    return [r for r in measured if any(r["gbps"] < SLOW_FRACTION * ref for ref in refs)]


def verdicts(rows: Sequence[Mapping[str, Any]], declared_gbps: float = 0.0) -> List[Dict[str, Any]]:
    """Checks: failed streams, each slow host (all its links one way slow), other slow links, and one
    summary line of what the links measured."""
    out = [
        check(
            "network",
            r["src"],
            False,
            "no stream %s -> %s: %s" % (r["src"], r["dst"], r["error"]),
            "open the ephemeral range (cluster spec ranges.ephemeral) between members: python -m alpa_job.cluster.firewall",
        )
        for r in rows
        if r["error"]
    ]
    measured = [r for r in rows if r["gbps"] is not None]
    if not measured:
        return out
    rates = [r["gbps"] for r in measured]
    median = statistics.median(rates) if len(measured) >= MIN_LINKS_FOR_MEDIAN else None
    slow = suspects(measured, declared_gbps)
    reference = "median of the links %s Gb/s" % _gbps(median) if median else ""
    if declared_gbps:
        reference += ("; " if reference else "") + "declared %s Gb/s" % _gbps(declared_gbps)
    explained = set()
    for host, way, links in _slow_hosts(measured, slow):
        explained.update((r["src"], r["dst"]) for r in links)
        out.append(
            check(
                "network",
                host,
                False,
                "every link %s %s is slow: %s (%s)"
                % (
                    way,
                    host,
                    ", ".join("%s %s Gb/s" % (r["dst"] if way == "from" else r["src"], _gbps(r["gbps"])) for r in links),
                    reference,
                ),
                "check %s's network interface (ethtool: speed, duplex, errors), its cable and switch port, and any "
                "traffic shaping on it (tc qdisc show)" % host,
            )
        )
    for r in slow:
        if (r["src"], r["dst"]) not in explained:
            out.append(
                check(
                    "network",
                    r["src"],
                    False,
                    "link %s -> %s at %s Gb/s (%s)" % (r["src"], r["dst"], _gbps(r["gbps"]), reference),
                    "check the path between %s and %s (switch ports, routes: ip route get %s)" % (r["src"], r["dst"], r["dst"]),
                )
            )
    rtts = [r["rtt_ms"] for r in measured if r["rtt_ms"] is not None]
    out.append(
        check(
            "network",
            None,
            not slow,
            "%d link(s) measured both ways: %s Gb/s median (min %s, max %s), "
            "round trip %s ms median"
            % (
                len(measured),
                _gbps(statistics.median(rates)),
                _gbps(min(rates)),
                _gbps(max(rates)),
                round(statistics.median(rtts), 3) if rtts else "-",
            ),
            "see the slow links above",
        )
    )
    return out


def _slow_hosts(measured: Sequence[Mapping[str, Any]], slow: Sequence[Mapping[str, Any]]):
    """(host, "from"|"to", its links) for each host with two or more links one way, every one slow."""
    found = []
    for key, way in (("src", "from"), ("dst", "to")):
        hosts = sorted({r[key] for r in measured})
        for host in hosts:
            mine = [r for r in measured if r[key] == host]
            if len(mine) >= 2 and all(r in slow for r in mine):
                found.append((host, way, mine))
    return found


def summary(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """What the planner reads (`plan --network-from`): the links' median and slowest Gb/s."""
    rates = [r["gbps"] for r in rows if r.get("gbps") is not None]
    return {
        "directions": len(rows),
        "measured": len(rates),
        "median_gbps": round(statistics.median(rates), 4) if rates else None,
        "min_gbps": round(min(rates), 4) if rates else None,
    }


def _gbps(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return "%.3g" % x
