"""`python -m alpa_job cluster preflight`: check every node of the inventory BEFORE any Ray exists there.

All nodes in parallel over SSH (fabric), the whole run under one deadline: a node that does not answer
in time is a failed check naming it, never a hang. Per node:

- ssh: the inventory's address/user/port/key get a shell;
- iface: exactly one interface holds an address in the cluster CIDR (node_ip.select_node_ip's verdict
  over the node's own `ip -j addr`), and it is the inventory's address when that lies in the CIDR;
- ports: nothing listens on the plan's fixed ports (ClusterSpec.member_tcp_ports for the node's role,
  ssh aside); listeners inside the Ray-worker / XLA ranges are a warning;
- engine, image (ray_runtime docker): the node's Docker Engine answers through the docker SDK (its
  socket forwarded over SSH), with the NVIDIA runtime when GPUs are expected; the image is on the node,
  or its registry has it (the engine asks the registry, `docker manifest inspect`-style), or the
  air-gapped archive exists;
- gpu (ray_gpus): nvidia-smi lists GPUs and the driver;
- shm: /dev/shm large enough (the doctor's rule; the docker runtime sizes the container's own);
- clock: the node's clock against the median of all nodes (Ray and NCCL timeouts, logs across nodes).

Output: a host x check matrix and the doctor's check lines; exit 3 on any failed check.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import statistics
import threading
import time
from typing import Any, Dict, List, Mapping, Optional

from alpa_job.cluster.doctor.checks import check, check_shm, gib
from alpa_job.cluster.doctor.render import grid
from alpa_job.cluster.node_ip import ips_in_cidr, select_node_ip
from alpa_job.errors import KitError
from alpa_job.cluster.control.inventory import Inventory, Node
from alpa_job.cluster.control.remote import Remote, RemoteError
from alpa_job import strict_json

DEFAULT_DEADLINE_S = 25.0
COLUMNS = ("ssh", "iface", "ports", "engine", "image", "gpu", "shm", "clock")
CLOCK_SKEW_MAX_S = 1.0  # beyond this, cross-node logs and Ray/NCCL timeouts stop lining up
WARN_RANGES = ("ray_workers", "xla_grpc")  # Ray/XLA pick free ports there: a squatter is a warning
PROBE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_probe.py")


def port_plan(spec, role: str) -> Dict[str, Any]:
    """{"fixed": [(name, port)], "ranges": [(name, lo, hi)]} that must be free on a node of `role`."""
    fixed = [(s.name, s.lo) for s in spec.member_tcp_ports(role) if not s.is_range and s.name != "ssh"]
    if role == "head":  # jax.distributed's coordinator binds on process 0's node (the head)
        fixed.append(("jax_coordinator", spec.jax_coordinator_port))
    ranges = [(name, lo, hi) for name, (lo, hi) in spec.ranges.items() if name in WARN_RANGES]
    return {"fixed": fixed, "ranges": ranges}


def _probe_command(node: Node, ask: Mapping[str, Any]) -> str:
    with open(PROBE_SOURCE) as f:
        code = base64.b64encode(f.read().encode()).decode()
    return "%s -c %s %s" % (
        shlex.quote(node.python),
        shlex.quote("import base64;exec(compile(base64.b64decode('%s'),'node_probe','exec'))" % code),
        shlex.quote(json.dumps(ask)),
    )


class NodePreflight:
    """One node's checks; runs in its own thread, appends to `.checks` as it learns."""

    def __init__(self, inv: Inventory, node: Node, deadline: float, connect_timeout_s: float):
        self.inv, self.node, self.deadline = inv, node, deadline
        self.connect_timeout_s = connect_timeout_s
        self.checks: List[Dict[str, Any]] = []
        self.step = "starting"
        self.facts: Dict[str, Any] = {}
        self.clock_offset: Optional[float] = None
        self.clock_error: Optional[float] = None
        self.done = threading.Event()

    def left(self, cap: float = float("inf")) -> float:
        return max(0.5, min(cap, self.deadline - time.monotonic()))

    def add(self, name: str, ok: bool, detail: str, fix: str = "", warn: bool = False) -> None:
        self.checks.append(check(name, self.node.name, ok, detail, fix, warn=warn))

    def run(self) -> None:
        try:
            with Remote(self.node, connect_timeout_s=self.left(self.connect_timeout_s)) as remote:
                self.step = "ssh"
                try:
                    remote.connect()
                except RemoteError as err:
                    self.add(
                        "ssh",
                        False,
                        str(err),
                        "check ansible_host / ansible_user / ansible_ssh_private_key_file "
                        "of %s in %s and that sshd answers there" % (self.node.name, self.inv.path),
                    )
                    return
                self.step = "probe"
                if not self.probe(remote):
                    return
                self.step = "clock"
                self.measure_clock(remote)
                self.add("ssh", True, "%s answers (hostname %s)" % (remote.describe(), self.facts.get("hostname")))
                self.step = "checks"
                self.check_iface()
                self.check_ports()
                self.check_shm()
                if self.inv.gpus:
                    self.check_gpu()
                if self.inv.runtime == "docker":
                    self.step = "docker"
                    self.check_docker(remote)
        except RemoteError as err:
            self.add(
                self.step if self.step in COLUMNS else "ssh", False, str(err), "check that %s is up and answers over SSH" % self.node.name
            )
        except Exception as err:  # a bug or an odd node: say which node, do not lose the others
            self.add(
                self.step if self.step in COLUMNS else "ssh",
                False,
                "%s: %s" % (type(err).__name__, err),
                "run the check by hand on %s" % self.node.name,
            )
        finally:
            self.done.set()

    # ---- facts -----------------------------------------------------------------------------------------
    def measure_clock(self, remote: Remote) -> None:
        """Offset of the node's clock from ours, corrected by half the round trip (its error bound)."""
        best = None
        for _ in range(2):
            t0 = time.time()
            try:  # a slow answer (a loaded node) widens the error bound; only no answer leaves it unmeasured
                r = remote.run("date +%s.%N", timeout_s=self.left())
                value = float(r.stdout.strip())
            except (RemoteError, ValueError):
                break
            t1 = time.time()
            if best is None or (t1 - t0) < best[1]:
                best = (value - (t0 + t1) / 2, t1 - t0)
        if best is not None:
            self.clock_offset, self.clock_error = best[0], best[1] / 2

    def probe(self, remote: Remote) -> bool:
        plan = port_plan(self.inv.spec(), self.node.role)
        ask = {"ports": [p for _, p in plan["fixed"]] + [[lo, hi] for _, lo, hi in plan["ranges"]], "gpu": bool(self.inv.gpus)}
        r = remote.run(_probe_command(self.node, ask), timeout_s=self.left(20))
        if r.rc == 127 or (r.rc != 0 and "not found" in r.why()):
            self.add(
                "ssh",
                False,
                "no %s on %s (%s)" % (self.node.python, self.node.name, r.why()),
                "install python3 on the node (Ansible needs it too) or set ansible_python_interpreter",
            )
            return False
        try:
            self.facts = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            self.add("ssh", False, "the node probe failed: %s" % r.why(), "run `%s -V` on %s" % (self.node.python, self.node.name))
            return False
        self.facts["plan"] = plan
        return True

    # ---- verdicts --------------------------------------------------------------------------------------
    def check_iface(self) -> None:
        cidr = self.inv.spec().cluster_cidr
        addresses = self.facts.get("addresses") or {}
        try:
            ip = select_node_ip(cidr, addresses)
        except KitError:
            inside = {i: ips_in_cidr(ips, cidr) for i, ips in addresses.items() if ips_in_cidr(ips, cidr)}
            if not inside:
                found = ", ".join("%s=%s" % (i, ",".join(ips)) for i, ips in sorted(addresses.items())) or "none"
                self.add(
                    "iface",
                    False,
                    "no interface has an address in cluster CIDR %s (found: %s)" % (cidr, found),
                    "set alpa_kit_cluster_cidr to the network the nodes share",
                )
            else:
                found = ", ".join("%s=%s" % (i, ",".join(ips)) for i, ips in sorted(inside.items()))
                self.add(
                    "iface",
                    False,
                    "%d addresses in cluster CIDR %s: %s (Ray would have to guess)" % (sum(len(v) for v in inside.values()), cidr, found),
                    "remove the extra address (ip addr del ADDR dev IFACE) or narrow alpa_kit_cluster_cidr so "
                    "it holds one interface of each node",
                )
            return
        iface = [i for i, ips in addresses.items() if ip in ips][0]
        self.facts["node_ip"] = ip
        mine = self.node.ip()
        if mine and ips_in_cidr([mine], cidr) and mine != ip:
            self.add(
                "iface",
                False,
                "the inventory says %s but the node's address in %s is %s (%s)" % (mine, cidr, ip, iface),
                "set ansible_host of %s to %s" % (self.node.name, ip),
            )
            return
        self.add("iface", True, "%s = %s, the one interface in %s" % (iface, ip, cidr))

    def check_ports(self) -> None:
        plan = self.facts["plan"]
        held = self.facts.get("listeners") or {}
        busy = [(name, port, held[str(port)]) for name, port in plan["fixed"] if str(port) in held]
        if busy:
            ray_up = any(h.startswith(("raylet", "gcs_server")) for _, _, hs in busy for h in hs)
            text = "; ".join("%d (%s) held by %s" % (port, name, ", ".join(hs)) for name, port, hs in busy)
            fix = (
                "Ray already runs there: `python -m alpa_job cluster down` first"
                if ray_up
                else "stop what holds it, or move the port in the inventory (alpa_kit_ports: {%s: OTHER_PORT})" % busy[0][0]
            )
            self.add("ports", False, "planned port(s) in use: " + text, fix)
        else:
            self.add("ports", True, "%d planned port(s) free (%s)" % (len(plan["fixed"]), ", ".join(str(p) for _, p in plan["fixed"])))
        for name, lo, hi in plan["ranges"]:
            inside = sorted(int(p) for p in held if lo <= int(p) <= hi)
            if inside:
                self.add(
                    "ports",
                    True,
                    "%d listener(s) inside the %s range %d-%d: %s"
                    % (len(inside), name, lo, hi, ", ".join("%d (%s)" % (p, ",".join(held[str(p)])) for p in inside[:5])),
                    "Ray skips busy ports, but keep %s free for the cluster" % name,
                    warn=True,
                )

    def check_shm(self) -> None:
        shm = self.facts.get("shm") or {}
        if self.inv.runtime == "docker":
            size = self.node.var("ray_cluster_shm_size", "16g")
            host = gib(shm["bytes"]) if shm.get("bytes") else "?"
            self.add("shm", True, "the container gets its own /dev/shm (ray_cluster_shm_size %s; the host's is %s)" % (size, host))
            return
        gpus = (self.facts.get("gpu") or {}).get("count") or 0
        self.checks.append(check_shm(self.node.name, shm, gpus))

    def check_gpu(self) -> None:
        gpu = self.facts.get("gpu") or {}
        if gpu.get("count"):
            self.add("gpu", True, "%d GPU(s) (%s), driver %s" % (gpu["count"], ", ".join(gpu.get("names") or []), gpu.get("driver")))
        else:
            self.add(
                "gpu",
                False,
                "ray_gpus is on but no GPU answers: %s" % (gpu.get("error") or "nvidia-smi lists none"),
                "install the NVIDIA driver on %s, or set ray_gpus: false for CPU-only nodes" % self.node.name,
            )

    def check_docker(self, remote: Remote) -> None:
        from alpa_job.cluster.control.docker_tunnel import DockerTunnel

        docker_host = self.inv.docker_host(self.node)
        with DockerTunnel(remote, docker_host, timeout_s=self.left(15)) as tunnel:
            try:
                client = tunnel.client()
                version = client.version()
                info = client.info()
            except Exception as err:
                said = "; ".join(tunnel.errors[-1:]) or _first_line(err)
                self.add(
                    "engine",
                    False,
                    "no Docker Engine answers at %s (%s)" % (docker_host, said),
                    "install/start Docker Engine on %s, or set alpa_kit_docker_host to its socket" % self.node.name,
                )
                return
            runtimes = sorted((info.get("Runtimes") or {}).keys())
            detail = "Docker Engine %s (API %s), runtimes: %s" % (
                version.get("Version"),
                version.get("ApiVersion"),
                ", ".join(runtimes) or "?",
            )
            if self.inv.gpus and "nvidia" not in runtimes and not info.get("CDISpecDirs"):
                self.add(
                    "engine",
                    False,
                    detail + "; no NVIDIA runtime",
                    "install nvidia-container-toolkit and run `nvidia-ctk runtime configure --runtime=docker` on "
                    "%s, or set ray_gpus: false" % self.node.name,
                )
            else:
                self.add("engine", True, detail)
            self.check_image(client)

    def check_image(self, client) -> None:
        import docker

        ref = self.inv.image()
        try:
            image = client.images.get(ref)
            self.add("image", True, "%s present (%s)" % (ref, (image.short_id or "").replace("sha256:", "")))
            return
        except docker.errors.ImageNotFound:
            pass
        source = self.inv.image_source()
        if source == "load":
            archive = str(self.node.var("alpa_kit_image_archive") or "")
            ok = bool(archive) and os.path.isfile(archive)
            self.add(
                "image",
                ok,
                "%s absent; the play loads it from %s" % (ref, archive or "(no archive set)"),
                "set alpa_kit_image_archive to a `docker save` tar on this controller",
            )
            return
        if source != "pull":
            self.add(
                "image",
                False,
                "%s is not on %s and alpa_kit_image_source is %s" % (ref, self.node.name, source),
                "push it to a registry and set alpa_kit_registry, or load it (docker load) on the node",
            )
            return
        try:  # the node's engine asks the registry for the manifest: reachable AND the tag exists
            dist = client.api.inspect_distribution(ref)
            digest = (dist.get("Descriptor") or {}).get("digest", "")
            self.add("image", True, "%s absent, pullable from its registry (%s)" % (ref, digest[:19]))
        except docker.errors.APIError as err:
            self.add(
                "image",
                False,
                "%s is neither on %s nor pullable: %s" % (ref, self.node.name, _first_line(err)),
                "push it (scripts/build-images, then docker push %s) or fix alpa_kit_registry / the tag" % ref,
            )


def _first_line(err: BaseException) -> str:
    text = getattr(err, "explanation", None) or str(err)
    return " ".join(str(text).split())[:300]


def run_preflight(inv: Inventory, deadline_s: float = DEFAULT_DEADLINE_S, connect_timeout_s: float = 5.0) -> Dict[str, Any]:
    """Every node in parallel, bounded by `deadline_s`; the JSON-ready result (ok, hosts, checks)."""
    t0 = time.monotonic()
    spec = inv.spec()  # a bad plan fails here, before any SSH
    deadline = t0 + deadline_s
    runs = [NodePreflight(inv, n, deadline, connect_timeout_s) for n in inv.nodes]
    threads = [threading.Thread(target=r.run, name="preflight-%s" % r.node.name, daemon=True) for r in runs]
    for t in threads:
        t.start()
    for r in runs:  # daemon threads: one stuck past the deadline is abandoned, not waited for
        r.done.wait(max(0.0, deadline - time.monotonic()))
    checks: List[Dict[str, Any]] = []
    for r in runs:
        checks.extend(list(r.checks))
        if not r.done.is_set():
            checks.append(
                check(
                    r.step if r.step in COLUMNS else "ssh",
                    r.node.name,
                    False,
                    "no answer within the %.0f s deadline (at: %s)" % (deadline_s, r.step),
                    "check that %s is up and reachable over SSH, or raise --deadline" % r.node.name,
                )
            )
    checks.extend(clock_checks(runs))
    hosts = {
        r.node.name: {
            "address": r.node.address,
            "role": r.node.role,
            "node_ip": r.facts.get("node_ip"),
            "hostname": r.facts.get("hostname"),
            "clock_offset_s": None if r.clock_offset is None else round(r.clock_offset, 3),
        }
        for r in runs
    }
    for name, h in hosts.items():
        h["cells"] = cells([c for c in checks if c["node"] == name])
    return {
        "inventory": inv.path,
        "cluster_cidr": spec.cluster_cidr,
        "runtime": inv.runtime,
        "image": inv.image() if inv.runtime == "docker" else None,
        "gpus": inv.gpus,
        "deadline_s": deadline_s,
        "seconds": round(time.monotonic() - t0, 2),
        "hosts": hosts,
        "checks": checks,
        "ok": all(c["ok"] for c in checks),
    }


def clock_checks(runs: List[NodePreflight]) -> List[Dict[str, Any]]:
    """Each node's clock against the median node (a wrong controller clock alone fails nothing)."""
    measured = [r for r in runs if r.clock_offset is not None]
    if not measured:
        return []
    median = statistics.median(r.clock_offset for r in measured)
    out = []
    for r in measured:
        skew = r.clock_offset - median
        text = "%+.3f s from the nodes' median (+-%.3f s; %+.3f s from this controller)" % (skew, r.clock_error, r.clock_offset)
        bad = abs(skew) - r.clock_error > CLOCK_SKEW_MAX_S
        out.append(
            check("clock", r.node.name, not bad, text, "synchronise the clocks (chrony or systemd-timesyncd on every node)" if bad else "")
        )
    return out


def cells(checks: List[Mapping[str, Any]]) -> Dict[str, str]:
    """{column: "ok" | "FAIL" | "warn" | "-"} of one host: its worst verdict per check name."""
    out = {}
    for col in COLUMNS:
        mine = [c for c in checks if c["name"] == col]
        if not mine:
            out[col] = "-"
        elif any(not c["ok"] for c in mine):
            out[col] = "FAIL"
        elif any(c.get("warn") for c in mine):
            out[col] = "warn"
        else:
            out[col] = "ok"
    return out


# ---- rendering (the doctor's layout) -------------------------------------------------------------------
def render_table(result: Mapping[str, Any]) -> str:
    lines = [
        "preflight: %s (cidr %s, runtime %s%s) in %.1f s: %s"
        % (
            result["inventory"],
            result["cluster_cidr"],
            result["runtime"],
            ", image %s" % result["image"] if result.get("image") else "",
            result["seconds"],
            "OK" if result["ok"] else "FAILED",
        ),
        "",
    ]
    rows = [
        (name + (" (head)" if h["role"] == "head" else ""), h["address"]) + tuple(h["cells"][c] for c in COLUMNS)
        for name, h in result["hosts"].items()
    ]
    lines += grid(("host", "address") + COLUMNS, rows)
    lines.append("")
    lines += [check_line(c) for c in result["checks"]]
    return "\n".join(lines)


def check_line(c: Mapping[str, Any]) -> str:
    mark = "ok  " if c["ok"] and not c.get("warn") else ("warn" if c["ok"] else "FAIL")
    return "%s %-6s %-10s %s%s" % (
        mark,
        c["name"],
        c["node"] or "*",
        c["detail"],
        "  -> fix: " + c["fix"] if (not c["ok"] or c.get("warn")) and c["fix"] else "",
    )


def failure_summary(result: Mapping[str, Any]) -> Optional[str]:
    failed = [c for c in result["checks"] if not c["ok"]]
    if not failed:
        return None
    first = failed[0]
    return "preflight: %d check(s) failed on %s; first: host %s: %s -> fix: %s" % (
        len(failed),
        ", ".join(sorted({c["node"] for c in failed if c["node"]})),
        first["node"],
        first["detail"],
        first["fix"],
    )


def render_json(result: Mapping[str, Any]) -> str:
    return strict_json.dumps(result, indent=2, sort_keys=True, default=str)
