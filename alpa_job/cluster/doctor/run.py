"""The doctor's driver: join, pin a probe to every alive node, run the phases, collect the result.

Every wait is bounded by the one `Deadline`; on the deadline the doctor records what it knows and fails.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from alpa_job.cluster import ray_api
from alpa_job.cluster.doctor import matrix
from alpa_job.cluster.doctor.checks import check, check_gpus, check_node_ip, check_shm, compare_versions, deadline_check
from alpa_job.cluster.doctor.probe import CONNECT_TIMEOUT_S, LISTEN_HOLD_S, NodeProbe
from alpa_job.cluster.worker_path import worker_pythonpath
from alpa_job.errors import KitError

DEFAULT_DEADLINE_S = 60.0
NODE_TIMEOUT_S = 10.0  # a probe pinned to a node must answer within this
HEAD_CONNECT_TIMEOUT_S = 5.0  # the first TCP check of the GCS address


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


def wait_refs(ray, refs: Mapping[str, Any], timeout_s: float) -> Tuple[Dict[str, Any], Dict[str, str]]:
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
    for key in by_ref.values():
        if key not in done and key not in failed:
            failed[key] = "timeout"
    return done, failed


def run_doctor(
    address: str,
    spec,
    deadline_s: float = DEFAULT_DEADLINE_S,
    node_timeout_s: float = NODE_TIMEOUT_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    skip_ports: Sequence[str] = (),
    network: bool = False,
) -> Dict[str, Any]:
    """Run every check against the cluster at `address`; returns the JSON-ready result.

    `spec`: the ClusterSpec the entry point resolved. `skip_ports`: names of planned ports/ranges not to
    probe (e.g. "ssh" on Kubernetes: pods run no sshd and k8s/networkpolicy.yaml does not open it).
    `network`: also measure every link between the nodes (network.py).
    """
    unknown = sorted(set(skip_ports) - set(spec.ports) - set(spec.ranges))
    if unknown:
        raise KitError(
            "--skip-ports names %s, not in the cluster spec; use names from: %s"
            % (", ".join(unknown), ", ".join(list(spec.ports) + list(spec.ranges)))
        )
    t0 = time.monotonic()
    deadline = Deadline(deadline_s)
    result: Dict[str, Any] = {
        "address": address,
        "cluster_cidr": spec.cluster_cidr,
        "spec": spec.source,
        "checks": [],
        "nodes": {},
        "matrix": {},
        "skipped_ports": sorted(set(skip_ports)),
    }
    address = ray_api.normalize_address(address, spec)
    ray_api.join_ray(
        address,
        max(0.1, deadline.left()),
        check_timeout_s=deadline.left(HEAD_CONNECT_TIMEOUT_S) or 0.1,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    import ray

    try:
        Session(ray, spec, deadline, node_timeout_s, connect_timeout_s, result, network).run(address)
    finally:
        result["seconds"] = round(time.monotonic() - t0, 2)
        result["ok"] = all(c["ok"] for c in result["checks"])
    return result


class Session:
    """One doctor run on a joined cluster: the nodes, a probe actor pinned to each, and the phases."""

    def __init__(
        self, ray, spec, deadline: Deadline, node_timeout_s: float, connect_timeout_s: float, result: Dict[str, Any], network: bool = False
    ):
        self.ray, self.spec, self.deadline, self.result = ray, spec, deadline, result
        self.network = network
        self.node_timeout_s, self.connect_timeout_s = node_timeout_s, connect_timeout_s
        self.checks: List[Dict[str, Any]] = result["checks"]
        self.nodes: Dict[str, ray_api.RayNode] = {}
        self.head: Optional[str] = None
        self.actors: Dict[str, Any] = {}
        # Every probe keeps the node's own PYTHONPATH visible (worker_path explains why).
        self.probe_env = {"env_vars": {"PYTHONPATH": worker_pythonpath()}}

    def run(self, address: str) -> None:
        if not self.find_nodes(address):
            return
        Probe = self.ray.remote(num_cpus=0)(NodeProbe)
        self.actors = {ip: Probe.options(runtime_env=self.probe_env, **ray_api.pin_to_node(ip)).remote() for ip in self.nodes}
        try:
            facts = self.probe_nodes()
            if self.deadline.passed:
                self.checks.append(deadline_check(self.deadline.seconds, "after the per-node probe"))
                return
            self.probe_ports(facts)
            if self.network and len(facts) > 1:
                self.probe_links([ip for ip in self.actors if ip in facts])
            elif self.network and facts:
                self.probe_one_node(next(ip for ip in self.actors if ip in facts))
        finally:
            for actor in self.actors.values():
                try:
                    self.ray.kill(actor)
                except Exception:
                    pass

    def find_nodes(self, address: str) -> bool:
        """The alive nodes and the head; a "nodes" check. False when there is no node to probe."""
        rows = ray_api.parse_nodes(self.ray.nodes())
        self.nodes = {n.ip: n for n in ray_api.alive_nodes(rows)}
        self.head = self.result["head"] = ray_api.head_ip(list(self.nodes.values()), address)
        if not self.nodes:
            self.checks.append(check("nodes", None, False, "no alive Ray node", "start the head and workers (ray start)"))
            return False
        dead = sorted({n.ip for n in rows if not n.alive} - set(self.nodes))
        self.checks.append(
            check(
                "nodes",
                None,
                True,
                "%d alive node(s): %s%s"
                % (len(self.nodes), ", ".join(sorted(self.nodes)), "; dead earlier: %s" % ", ".join(dead) if dead else ""),
                warn=bool(dead),
            )
        )
        return True

    # ---- phase 0: a probe pinned to every node reports its facts --------------------------------------
    def probe_nodes(self) -> Dict[str, Dict[str, Any]]:
        timeout = self.deadline.left(self.node_timeout_s)
        facts, failed = wait_refs(self.ray, {ip: a.facts.remote() for ip, a in self.actors.items()}, timeout)
        nm_port = self.spec.ports["node_manager"]
        for ip in sorted(failed):
            if failed[ip] == "timeout":
                detail = "a task pinned to it did not finish in %.0f s; its node-manager port %d is probably blocked" % (timeout, nm_port)
            else:
                detail = "a task pinned to it failed: %s" % failed[ip]
            self.checks.append(
                check(
                    "tasks",
                    ip,
                    False,
                    detail,
                    "open the ports in the cluster spec (python -m "
                    "alpa_job.cluster.firewall) and check its Ray logs under /tmp/ray/session_latest/logs",
                )
            )
        for ip in sorted(facts):
            self.node_checks(ip, facts[ip])
        if len(facts) > 1:
            self.checks.extend(compare_versions({ip: f["versions"] for ip, f in facts.items()}, prefer=self.head))
        return facts

    def node_checks(self, ip: str, f: Mapping[str, Any]) -> None:
        """What one node's facts say: its row in result["nodes"] and its checks."""
        ray_gpus = self.nodes[ip].resources.get("GPU", 0)
        cidr = self.spec.cluster_cidr
        self.result["nodes"][ip] = {
            "hostname": f["hostname"],
            "addresses": f["addresses"],
            "versions": f["versions"],
            "shm_bytes": f["shm"].get("bytes"),
            "gpus": f["gpu"].get("count"),
            "gpu_source": f["gpu"].get("source"),
            "head": ip == self.head,
            "ray_gpus": ray_gpus,
        }
        self.checks.append(check("tasks", ip, True, "a pinned task ran on %s (%s)" % (ip, f["hostname"])))
        self.checks.extend(check_node_ip(ip, ip, f["addresses"], cidr))
        if f["ray_ip"] != ip:
            self.checks.append(
                check(
                    "node_ip",
                    ip,
                    False,
                    "a task on node %s sees Ray IP %s" % (ip, f["ray_ip"]),
                    "restart it with --node-ip-address=<its address in %s>" % cidr,
                )
            )
        self.checks.append(check_shm(ip, f["shm"], f["gpu"].get("count") or 0))
        self.checks.append(check_gpus(ip, f["gpu"], ray_gpus))

    # ---- phases 1-3: ports, all pairs -----------------------------------------------------------------
    def probe_ports(self, facts: Mapping[str, Any]) -> None:
        fixed_by_role, ranges = matrix.listen_plan(self.spec, self.result.get("skipped_ports") or ())
        listening = self.open_listeners(facts, fixed_by_role, ranges)
        plan, listen_checks = matrix.target_plan(self.nodes, listening, fixed_by_role, self.head)
        self.checks.extend(listen_checks)
        self.result["probed_ports"] = {ip: ["%d %s" % (p["port"], p["name"]) for p in plan[ip]] for ip in plan}
        connected, failed = self.connect_all_pairs(plan, [ip for ip in self.nodes if ip in listening or ip in facts])
        self.close_listeners(listening)
        for src, why in sorted(failed.items()):
            self.checks.append(
                check("ports", src, False, "the connect probe from %s did not finish: %s" % (src, why), "check the node's Ray logs")
            )
        self.result["matrix"], blocked = matrix.build_matrix(list(self.nodes), plan, connected)
        self.checks.extend(matrix.blocked_checks(self.spec, blocked))
        if not blocked and connected and len(self.nodes) > 1:
            self.checks.append(matrix.all_connected_check(connected, len(self.nodes)))
        if self.deadline.passed:
            self.checks.append(deadline_check(self.deadline.seconds, "during the port probe"))

    def open_listeners(self, facts, fixed_by_role, ranges) -> Dict[str, List[Dict[str, Any]]]:
        """Phase 1: listeners on every node that answered (head-only ports on the head only)."""
        refs = {ip: self.actors[ip].listen.remote(ip, fixed_by_role[matrix.role_of(ip, self.head)], ranges, LISTEN_HOLD_S) for ip in facts}
        listening, failed = wait_refs(self.ray, refs, self.deadline.left(self.node_timeout_s))
        for ip, why in sorted(failed.items()):
            self.checks.append(check("ports", ip, False, "could not open probe listeners: %s" % why, "check the node's Ray logs"))
        return listening

    def connect_all_pairs(self, plan, sources: Sequence[str]) -> Tuple[Dict[str, List[Dict[str, Any]]], Dict[str, str]]:
        """Phase 2: every responsive node connects to every other node's planned ports; (results, failures)."""
        refs = {src: self.actors[src].connect.remote(matrix.connect_targets(src, plan), self.connect_timeout_s) for src in sources}
        need = self.connect_timeout_s * 4 + 5  # parallel connects: a few rounds of timeouts at most
        return wait_refs(self.ray, refs, self.deadline.left(max(need, self.node_timeout_s)))

    # ---- phase 4 (--network): the links between every pair, both ways ---------------------------------
    def probe_links(self, nodes: Sequence[str]) -> None:
        from alpa_job.cluster.doctor import network

        declared = self.spec.network.gbps
        rows, checks = network.measure(
            self.ray,
            {ip: self.actors[ip] for ip in nodes},
            self.spec,
            self.deadline,
            self.connect_timeout_s,
            self.node_timeout_s,
            wait_refs,
        )
        self.result["network"] = {"links": rows, "declared_gbps": declared, **network.summary(rows)}
        self.checks.extend(checks + network.verdicts(rows, declared))
        self.check_routes(nodes)
        if self.deadline.passed:
            self.checks.append(deadline_check(self.deadline.seconds, "during the link probe"))
            return
        self.all_reduce(nodes, declared)

    def probe_one_node(self, ip: str) -> None:
        """--network on one node: no link to stream; a node of several GPUs still has its all-reduce (NVLink
        or PCIe, and the transports NCCL chose between its GPUs)."""
        declared = self.spec.network.gbps
        from alpa_job.cluster.doctor import network

        self.result["network"] = {"links": [], "declared_gbps": declared, **network.summary([])}
        if self.nodes[ip].resources.get("GPU", 0) >= 2:
            self.all_reduce([ip], declared)

    def check_routes(self, nodes: Sequence[str]) -> None:
        """Each worker's route to the head leaves from its Ray address."""
        from alpa_job.cluster.doctor import network

        others = [ip for ip in nodes if ip != self.head]
        routes, _ = wait_refs(
            self.ray, {ip: self.actors[ip].route_to.remote(self.head) for ip in others}, self.deadline.left(self.node_timeout_s)
        )
        self.result["network"]["routes_to_head"] = routes
        ifaces = {
            ip: next((name for name, ips in (self.result["nodes"].get(ip, {}).get("addresses") or {}).items() if ip in ips), None)
            for ip in others
        }
        self.checks.extend(network.route_checks(routes, ifaces, self.head or "?"))

    def all_reduce(self, nodes: Sequence[str], declared: float) -> None:
        """One JAX process a node (with the node's GPUs), joined as a job joins them, times an all-reduce."""
        from alpa_job.cluster.doctor import collective

        ordered = sorted(nodes, key=lambda ip: (ip != self.head, ip))  # the coordinator on the head
        # One below the job's own coordinator port: a doctor run beside a training job must not take its port.
        coordinator = "%s:%d" % (ordered[0], self.spec.jax_coordinator_port - 1)
        probe = self.ray.remote(max_calls=1, num_cpus=0)(collective.all_reduce)  # a fresh process each
        nbytes = collective.probe_bytes(self.result["network"].get("min_gbps"))
        refs = {
            ip: probe.options(
                num_gpus=self.nodes[ip].resources.get("GPU", 0), runtime_env=self.probe_env, **ray_api.pin_to_node(ip)
            ).remote(coordinator, len(ordered), i, nbytes)
            for i, ip in enumerate(ordered)
        }
        done, failed = wait_refs(self.ray, refs, self.deadline.left(collective.JOIN_TIMEOUT_S + 30))
        for ip in failed:  # a process still waiting to join: its worker is killed, not left waiting
            try:
                self.ray.cancel(refs[ip], force=True)
            except Exception:
                pass
        fabric = self.spec.network.fabric
        first = done[ordered[0]] if ordered[0] in done else None
        self.result["network"]["all_reduce"] = (
            None
            if first is None
            else {
                **{k: first[k] for k in ("backend", "devices", "bytes", "seconds")},
                "bus_gbps": first["bus_gbps"],
                "nccl_lines": sum(len(r.get("nccl_lines") or []) for r in done.values()),
            }
        )
        self.checks.extend(collective.verdicts(done, failed, declared, fabric))

    def close_listeners(self, listening) -> None:
        """Phase 3: close the listeners (they also close themselves after LISTEN_HOLD_S)."""
        try:
            self.ray.get([self.actors[ip].close.remote() for ip in listening], timeout=self.deadline.left(5.0) or 0.1)
        except Exception:
            pass
