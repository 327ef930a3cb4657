"""`python -m alpa_job cluster status`: the running cluster, from Ray's state API, against the inventory.

Asks the head's dashboard (the jobs API address, http://<head>:<dashboard port>): whether token auth is
on, the Ray version and session, and the state API's node table (alive and dead nodes, IPs, head,
resources). Ray refuses a node whose Ray version differs from the head's at join, so the head's
version is every alive node's. Then compares with the inventory: the head Ray reports must be the
inventory's head, every inventory node must be alive, and no alive node may be missing from the
inventory; a mismatch is exit 3 naming the node.

Nodes are matched by IP: the inventory's ansible_host when it lies in the cluster CIDR (Ray's node
IPs always do). A host whose SSH address is elsewhere (a management network) is matched by count only.
"""

from __future__ import annotations

import re
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from alpa_job.cluster import ray_api
from alpa_job.cluster.doctor.render import grid
from alpa_job.cluster.node_ip import ips_in_cidr
from alpa_job.errors import EXIT_TIMEOUT, KitError
from alpa_job.cluster.control.inventory import Inventory
from alpa_job.cluster.control.ray_http import RayHttp, RayHttpError, dashboard_url, token_from_env
from alpa_job import strict_json

RESOURCE_COLUMNS = ("CPU", "GPU", "memory", "object_store_memory")


def head_url(inv: Optional[Inventory], address: Optional[str] = None) -> str:
    """The jobs API URL: `address` (a URL, or a host given the spec's dashboard port), else the inventory head's.
    Without an inventory the spec is cluster.yaml (+ $ALPA_KIT_CLUSTER_SPEC)."""
    if inv is None:
        from alpa_job.cluster.spec import load_spec

        spec = load_spec()
        if not address:
            raise KitError("no inventory and no --address: pass --address HEAD or --inventory FILE")
    else:
        spec = inv.spec()
    if address:
        if "://" in address:
            return address.rstrip("/")
        host = address.rpartition(":")[0] if ":" in address else address
        return dashboard_url(spec, host)
    ip = inv.head.ip()
    if ip is None:
        raise KitError(
            "inventory head %s has address %r, which does not resolve; pass --address http://HEAD:%d"
            % (inv.head.name, inv.head.address, spec.ports["dashboard"])
        )
    return dashboard_url(spec, ip)


def client_token(inv: Optional[Inventory]) -> Optional[str]:
    """The Ray token: the inventory's (RAY_AUTH_TOKEN, else the play's file), without one RAY_AUTH_TOKEN(_PATH)."""
    return inv.auth_token() if inv is not None else token_from_env()


def ray_silent(url: str, timeout_s: float, err: KitError, instead: str) -> KitError:
    """Without an inventory, Ray is the only source: when it cannot be reached, one line saying so and what to
    pass instead. An answer that is an error (a refused token, HTTP 500) stays that error: its fix is not an
    inventory."""
    from alpa_job.cluster.control.inventory import DEFAULT_INVENTORY

    if err.exit_code != EXIT_TIMEOUT:  # the dashboard answered: ray_http's message names the fix
        return err
    errno = re.search(r"\[Errno -?\d+\] ([^\"')]+)", str(err))  # requests' chained text: the socket's own words
    why = errno.group(1).strip() if errno else "no answer"
    return KitError(
        "Ray at %s did not answer within %.0f s (%s); %s, pass --inventory FILE (there is none at %s)"
        % (url, timeout_s, why[:200], instead, DEFAULT_INVENTORY)
    )


def cluster_status(inv: Optional[Inventory], address: Optional[str] = None, timeout_s: float = 10.0) -> Dict[str, Any]:
    """The JSON-ready status: jobs_api, auth, ray_version, nodes, problems, ok. `inv` None: Ray's view alone
    (`compared` false: no inventory to hold it against)."""
    t0 = time.monotonic()
    url = head_url(inv, address)
    api = RayHttp(url, token=client_token(inv), timeout_s=timeout_s)
    found_elsewhere = None
    try:
        auth = api.auth_mode()  # public endpoint: also the first "is the head there" probe
    except RayHttpError as err:
        if inv is None:
            raise ray_silent(url, timeout_s, err, "to compare the cluster with your hosts") from None
        if address:
            raise
        api, auth = _head_elsewhere(inv, timeout_s, err)
        found_elsewhere = api.url
        url = api.url
    version = api.version()
    rows = ray_api.parse_nodes(api.nodes())
    names = inv.by_ip() if inv is not None else {}
    nodes = []
    for n in sorted(rows, key=lambda n: (not n.alive, n.ip)):
        nodes.append(
            {
                "ip": n.ip,
                "host": names.get(n.ip),
                "alive": n.alive,
                "head": bool(n.is_head),
                "node_id": n.node_id,
                "state_message": _field(n.row, "state_message"),
                "node_name": _field(n.row, "node_name"),
                "resources": {k: n.resources[k] for k in RESOURCE_COLUMNS if k in n.resources},
            }
        )
    result = {
        "inventory": inv.path if inv is not None else None,
        "compared": inv is not None,
        "jobs_api": url,
        "auth": auth,
        "token_given": bool(api.token),
        "ray_version": version.get("ray_version"),
        "ray_commit": version.get("ray_commit"),
        "session": version.get("session_name"),
        "nodes": nodes,
        "expected": {"head": inv.head.name, "workers": [w.name for w in inv.workers]} if inv is not None else None,
    }
    result["problems"] = compare(inv, nodes) if inv is not None else []
    if found_elsewhere:
        result["problems"].insert(
            0,
            {
                "node": inv.head.name,
                "problem": "the inventory's head %s (%s) serves no Ray "
                "dashboard; Ray's head answers at %s" % (inv.head.name, inv.head.address, found_elsewhere),
                "fix": "point ray_head at the node Ray runs its head on, or cluster down + up",
            },
        )
    result["ok"] = not result["problems"]
    result["seconds"] = round(time.monotonic() - t0, 2)
    return result


def _head_elsewhere(inv: Inventory, timeout_s: float, first: RayHttpError) -> Tuple[RayHttp, str]:
    """The inventory head has no dashboard: is Ray's head another inventory node? Else the first error."""
    spec = inv.spec()
    for node in inv.workers:
        ip = node.ip()
        if not ip:
            continue
        api = RayHttp(dashboard_url(spec, ip), token=inv.auth_token(), timeout_s=min(timeout_s, 3.0))
        try:
            auth = api.auth_mode()
        except RayHttpError:
            continue
        api.timeout_s = timeout_s
        return api, auth
    raise first


def _field(row: Any, name: str) -> Any:
    return row.get(name) if isinstance(row, Mapping) else getattr(row, name, None)


def compare(inv: Inventory, nodes: List[Mapping[str, Any]]) -> List[Dict[str, str]]:
    """What differs between the inventory and the alive nodes: [{node, problem, fix}]."""
    cidr = inv.spec().cluster_cidr
    alive = {n["ip"]: n for n in nodes if n["alive"]}
    problems = []
    matched = set()
    unmatched_hosts = []
    for node in inv.nodes:
        ip = node.ip()
        if not ip or not ips_in_cidr([ip], cidr):
            unmatched_hosts.append(node.name)
            continue
        matched.add(ip)
        if ip not in alive:
            dead = [n for n in nodes if n["ip"] == ip]
            problems.append(
                {
                    "node": node.name,
                    "problem": "%s (%s) is in the inventory but %s"
                    % (
                        node.name,
                        ip,
                        "its Ray node is dead" + (": " + dead[0]["state_message"] if dead[0].get("state_message") else "")
                        if dead
                        else "has no Ray node",
                    ),
                    "fix": "python -m alpa_job cluster up (or cluster logs to see why it died)",
                }
            )
            continue
        if node.role == "head" and not alive[ip]["head"]:
            problems.append(
                {
                    "node": node.name,
                    "problem": "the inventory's head %s (%s) is a worker in Ray; Ray's head "
                    "is %s" % (node.name, ip, ", ".join(i for i, n in alive.items() if n["head"]) or "unknown"),
                    "fix": "point ray_head at the node Ray runs its head on, or cluster down + up",
                }
            )
        if node.role == "worker" and alive[ip]["head"]:
            problems.append(
                {
                    "node": node.name,
                    "problem": "%s (%s) is Ray's head but a worker in the inventory" % (node.name, ip),
                    "fix": "put %s under ray_head, or cluster down + up" % node.name,
                }
            )
    extra = sorted(set(alive) - matched)
    if len(extra) > len(unmatched_hosts):  # more alive nodes than the inventory accounts for
        named = extra if not unmatched_hosts else extra[: len(extra) - len(unmatched_hosts)]
        for ip in named:
            problems.append(
                {
                    "node": ip,
                    "problem": "Ray node %s is alive but not in the inventory %s" % (ip, inv.path),
                    "fix": "add it to ray_workers, or stop Ray there (cluster down with it listed)",
                }
            )
    elif len(extra) < len(unmatched_hosts):
        problems.append(
            {
                "node": ", ".join(unmatched_hosts),
                "problem": "%d inventory host(s) outside the cluster CIDR "
                "(%s) but only %d alive Ray node(s) unaccounted for" % (len(unmatched_hosts), cidr, len(extra)),
                "fix": "python -m alpa_job cluster up, then cluster status again",
            }
        )
    return problems


def render_table(result: Mapping[str, Any]) -> str:
    alive = [n for n in result["nodes"] if n["alive"]]
    lines = [
        "cluster: %s  Ray %s  auth %s%s  session %s: %s"
        % (
            result["jobs_api"],
            result["ray_version"],
            result["auth"],
            "" if result["auth"] != "token" else (" (token given)" if result["token_given"] else " (NO token given)"),
            result["session"],
            ("OK" if result["ok"] else "DIFFERS FROM THE INVENTORY")
            if result.get("compared", True)
            else "Ray's view; not compared against an inventory (none given: pass --inventory FILE to compare)",
        ),
        "",
    ]
    rows = []
    for n in result["nodes"]:
        r = n["resources"]
        rows.append(
            (
                n["ip"] + (" (head)" if n["head"] else ""),
                n["host"] or "-",
                n.get("node_name") or "-",
                "alive" if n["alive"] else "DEAD",
                _num(r.get("CPU")),
                _num(r.get("GPU")),
                _bytes(r.get("memory")),
                _bytes(r.get("object_store_memory")),
            )
        )
    lines += grid(("node", "inventory host", "Ray node name", "state", "CPU", "GPU", "memory", "object store"), rows)
    lines.append("")
    lines.append("%d alive node(s); jobs: RAY_ADDRESS=%s ray job submit -- ..." % (len(alive), result["jobs_api"]))
    for p in result["problems"]:
        lines.append("FAIL %s: %s  -> fix: %s" % (p["node"], p["problem"], p["fix"]))
    return "\n".join(lines)


def failure_summary(result: Mapping[str, Any]) -> Optional[str]:
    if result["ok"]:
        return None
    first = result["problems"][0]
    return "cluster status: %d difference(s) from the inventory; first: %s -> fix: %s" % (
        len(result["problems"]),
        first["problem"],
        first["fix"],
    )


def render_json(result: Mapping[str, Any]) -> str:
    return strict_json.dumps(result, indent=2, sort_keys=True, default=str)


def _num(v: Any) -> str:
    return "-" if v is None else ("%g" % v)


def _bytes(v: Any) -> str:
    if not v:
        return "-"
    return "%.1f GiB" % (float(v) / (1 << 30))
