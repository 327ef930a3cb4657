"""Read NCCL's own INFO log: which transports it chose, on which interface, and what is wrong with that.

A multi-node job whose NCCL fell back to TCP sockets (no /dev/infiniband in the container, IB disabled
by an environment variable left over, or sockets bound to the loopback interface) runs, only slowly:
nothing fails. NCCL says so only in its INFO log (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET), one
line per fact, among many others. This module reads those lines, from one file or from several
processes' logs mixed together, into a summary per process, and turns the summary into verdicts:
one line per problem, naming the host(s) and the fix.

What it reads (each line as NCCL prints it, whatever comes before NCCL's own `HOST:PID:TID [DEV]`
prefix: a timestamp, or Ray's `(JaxProcess pid=..., ip=...)` when the lines came through Ray's log
stream):

- `NCCL version 2.28.9+cuda13.0`
- `Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0` (also P2P/..., SHM/..., NET/IB/...,
  NET/<plugin>/...): one connection of one channel, counted by transport kind;
- `N coll channels, N collnet channels, N nvls channels, ...`: NVLink SHARP (NVLS) has no per-channel
  line, so its channels are counted from here;
- `Using network Socket|IB|IBext_v8|...`: the NET plugin a communicator uses;
  `Failed to initialize NET plugin IB`, `NET/IB : No device found.` and `net_ib` source lines: IB did
  not come up;
- `NET/Socket : Using [0]lo:127.0.0.1<0>` and `NET/IB : Using [0]mlx5_0:1/IB ... ; OOB eth0:...`:
  the interfaces and HCAs NCCL bound;
- `NCCL_X set by environment to V` / `NCCL_X set to V`: overrides NCCL reports;
- `comm 0x... rank 1 nRanks 2 nNodes 2 localRanks 1 ...`: how many hosts and ranks it saw.

Ray folds identical lines of several processes into one ("[repeated 3x across cluster]"); such a
line is read once, so channel counts from Ray's stream are a lower bound (the workers' own log files
are exact). Pure standard library: it runs on the Alpa image's Python 3.9 and needs neither jax nor ray.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from alpa_job.cluster.fabric import FABRICS, RDMA_FABRICS  # noqa: F401 - the fabrics, declared once
from alpa_job.errors import KitError

NCCL_DEBUG_HINT = "run with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET"
# How RDMA reaches a container; one place, so every verdict that needs it says the same.
RDMA_INTO_CONTAINER = (
    "pass /dev/infiniband, IPC_LOCK and unlimited memlock into the container (Ansible does for fabric ib/roce; k8s: the rdma overlay)"
)
# Files a run directory or a collected-logs folder keeps NCCL's lines in (train.log, ray.log, Ray's
# worker-*.out/.err); checkpoints and reports are skipped by name.
LOG_SUFFIXES = (".log", ".out", ".err", ".txt")

# NCCL's prefix: "HOST:PID:TID [DEV] NCCL INFO msg", or "... [DEV] file.cc:LINE (func) NCCL WARN msg".
_NCCL_LINE = re.compile(r"(?:^|\s)([^\s:()\[\]]+):(\d+):(\d+) \[(\d+)\] (?:\S+:\d+ (?:\(\S+\) )?)?NCCL (INFO|WARN) (.*)$")
_RAY_PREFIX = re.compile(r"^\((?:[^\s()]+ )?pid=(\d+)(?:, ip=([^\s()]+))?\)")
_RAY_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")
_VERSION = re.compile(r"NCCL version (\S+)")
# Older NCCL prints "Channel 00 : 0[1b000] -> 1[43000] via P2P/CUMEM" (no connection index, bus ids);
# the transport runs to the line's end ("via P2P/direct pointer").
_CHANNEL = re.compile(r"^Channel \d+(?:/\d+)? : \d+\[\w+\] -> \d+\[\w+\](?: \[(?:send|receive)\])? via (.+?)\s*$")
_NVLS_CHANNELS = re.compile(r"\b(\d+) nvls channels\b")
_USING_NETWORK = re.compile(r"^Using network (\S+)")
_NET_FAILED = re.compile(r"^Failed to initialize NET plugin (\S+)")
_SOCKET_USING = re.compile(r"^NET/Socket : Using(.*)$")
_SOCKET_IFACE = re.compile(r"\[\d+\]([^:\s\]]+):([^\s<]+)<\d+>")
_IB_USING = re.compile(r"^NET/IB : Using(.*?)(?:; OOB ([^:\s]+):([^\s<]+)<\d+>)?\s*$")
_IB_DEVICE = re.compile(r"\[\d+\]([^\s;\[\]]+)")
_ENV = re.compile(r"^(NCCL_[A-Z0-9_]+) set (?:by environment )?to (.*?)\.?$")
_COMM = re.compile(r"^comm \S+ rank (\d+) nRanks (\d+) nNodes (\d+) localRanks (\d+)")


@dataclass
class ProcessNccl:
    """What one process's NCCL said (all its communicators together)."""

    host: str  # NCCL's %H: the hostname as the process saw it
    pid: int
    ip: str = ""  # Ray's `ip=` prefix, when the lines came through Ray's log stream
    version: str = ""
    channels: Dict[str, int] = field(default_factory=dict)  # kind (NET/Socket, P2P, ...) -> connections
    details: Dict[str, int] = field(default_factory=dict)  # NCCL's own words ("NET/Socket/0/Shared") -> count
    networks: List[str] = field(default_factory=list)  # NET plugins its communicators use ("Socket", "IB")
    failed_networks: List[str] = field(default_factory=list)  # NET plugins that did not initialise
    ib_no_device: bool = False
    ib_errors: List[str] = field(default_factory=list)  # NCCL's lines from its IB transport's sources
    socket_ifaces: List[Tuple[str, str]] = field(default_factory=list)  # (interface, address)
    ib_devices: List[str] = field(default_factory=list)  # "mlx5_0:1/IB"
    ib_oob: Optional[Tuple[str, str]] = None  # the interface IB's out-of-band setup uses
    env: Dict[str, str] = field(default_factory=dict)  # NCCL_* overrides NCCL reported
    n_nodes: int = 0  # the largest of its communicators (0: no `comm ... nNodes` line)
    n_ranks: int = 0
    local_ranks: int = 0
    lines: int = 0

    @property
    def where(self) -> str:
        """How verdicts name this process's host: the hostname, with Ray's node IP when known."""
        if self.ip and self.host:
            return "%s (%s)" % (self.host, self.ip)
        return self.host or self.ip or "pid %d" % self.pid

    @property
    def uses_sockets(self) -> bool:
        return "NET/Socket" in self.channels or "Socket" in self.networks

    @property
    def across_hosts(self) -> bool:
        """Its collectives leave the host: NCCL counted more than one node, or set up NET channels."""
        return self.n_nodes > 1 or any(kind.startswith("NET/") for kind in self.channels)

    @property
    def ib_failed(self) -> bool:
        """IB did not come up at all (a failed IBext plugin with NCCL's own IB working is no failure)."""
        if self.ib_devices or any(n.startswith("IB") for n in self.networks):
            return False
        return self.ib_no_device or bool(self.ib_errors) or any(n.startswith("IB") for n in self.failed_networks)


@dataclass
class NcclSummary:
    """Every process's account, in the order their first lines came."""

    processes: List[ProcessNccl] = field(default_factory=list)
    versions: List[str] = field(default_factory=list)
    lines: int = 0  # NCCL lines read

    def channels(self) -> Dict[str, int]:
        """Connections per transport kind, all processes together."""
        total: Dict[str, int] = {}
        for p in self.processes:
            for kind, n in p.channels.items():
                total[kind] = total.get(kind, 0) + n
        return total

    def n_nodes(self) -> int:
        return max([p.n_nodes for p in self.processes] or [0])

    def hosts(self) -> List[str]:
        return _unique(p.where for p in self.processes)

    def to_dict(self) -> dict:
        """Plain JSON-able data (a run report or `doctor --format json`)."""
        data = asdict(self)
        for p, raw in zip(self.processes, data["processes"]):
            raw["where"] = p.where
        data.update(channels_by_transport=self.channels(), n_nodes=self.n_nodes())
        return data


def transport_kind(detail: str) -> str:
    """NCCL's `via` word -> its kind: NET/IB (any IB plugin, IBext too), NET/Socket, NET/<plugin>, P2P, SHM."""
    parts = detail.split("/")
    if parts[0] == "NET" and len(parts) > 1:
        name = parts[1]
        return "NET/IB" if name.startswith("IB") else "NET/" + name
    return parts[0]


def parse_lines(lines: Iterable[str], summary: Optional[NcclSummary] = None) -> NcclSummary:
    """Read NCCL lines (others are skipped) into `summary` (a new one when None) and return it."""
    summary = summary if summary is not None else NcclSummary()
    by_key = {(p.ip, p.host, p.pid): p for p in summary.processes}
    for raw in lines:
        if "NCCL" not in raw:
            continue
        text = _RAY_REPEATED.sub("", raw.rstrip("\r\n"))
        ray = _RAY_PREFIX.match(text)
        nccl = _NCCL_LINE.search(text)
        if nccl is None:  # NCCL prints its version line to rank 0's stdout without the prefix
            version = _VERSION.search(text)
            if version and version.group(1) not in summary.versions:
                summary.versions.append(version.group(1))
            continue
        host, pid, level, message = nccl.group(1), int(nccl.group(2)), nccl.group(5), nccl.group(6).strip()
        key = ((ray.group(2) or "") if ray else "", host, pid)
        process = by_key.get(key)
        if process is None:
            process = by_key[key] = ProcessNccl(host=host, pid=pid, ip=key[0])
            summary.processes.append(process)
        summary.lines += 1
        process.lines += 1
        _read_message(process, message, level, summary)
    return summary


def _read_message(p: ProcessNccl, message: str, level: str, summary: NcclSummary) -> None:
    if "net_ib" in message:  # e.g. "transport/net_ib.cc:852 -> 3": an error unwinding from IB's setup
        p.ib_errors.append(message)
    m = _CHANNEL.match(message)
    if m:
        detail = m.group(1)
        p.details[detail] = p.details.get(detail, 0) + 1
        kind = transport_kind(detail)
        p.channels[kind] = p.channels.get(kind, 0) + 1
        return
    if level != "INFO":
        return
    m = _VERSION.search(message)
    if m:
        p.version = m.group(1)
        if m.group(1) not in summary.versions:
            summary.versions.append(m.group(1))
        return
    m = _NVLS_CHANNELS.search(message)
    if m and int(m.group(1)) > 0:
        p.channels["NVLS"] = p.channels.get("NVLS", 0) + int(m.group(1))
        return
    m = _USING_NETWORK.match(message)
    if m:
        _add(p.networks, m.group(1))
        return
    m = _NET_FAILED.match(message)
    if m:
        _add(p.failed_networks, m.group(1))
        return
    if message.startswith("NET/IB : No device found"):
        p.ib_no_device = True
        return
    m = _SOCKET_USING.match(message)
    if m:
        for iface in _SOCKET_IFACE.findall(m.group(1)):
            _add(p.socket_ifaces, iface)
        return
    m = _IB_USING.match(message)
    if m:
        for device in _IB_DEVICE.findall(m.group(1)):
            _add(p.ib_devices, device)
        if m.group(2):
            p.ib_oob = (m.group(2), m.group(3))
        return
    m = _ENV.match(message)
    if m:
        p.env[m.group(1)] = m.group(2)
        return
    m = _COMM.match(message)
    if m:
        p.n_ranks = max(p.n_ranks, int(m.group(2)))
        p.n_nodes = max(p.n_nodes, int(m.group(3)))
        p.local_ranks = max(p.local_ranks, int(m.group(4)))


def read_logs(paths: Sequence[str]) -> NcclSummary:
    """Read NCCL's lines from files, and from every log file under each directory given (a run
    directory, or `cluster logs`' DIR/<host>/ folders). A path that does not exist is a KitError."""
    summary = NcclSummary()
    for path in paths:
        if os.path.isdir(path):
            files = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names if name.endswith(LOG_SUFFIXES))
        elif os.path.isfile(path):
            files = [path]
        else:
            raise KitError("NCCL log %s does not exist; give a log file or a run directory" % path)
        for name in files:
            try:
                with open(name, errors="replace") as f:
                    parse_lines(f, summary)
            except OSError as err:
                raise KitError("cannot read NCCL log %s (%s)" % (name, err.strerror or err)) from err
    return summary


def run_summary(run_dir_or_files) -> NcclSummary:
    """The NCCL summary of a run: its directory (every log file in it) or a list of log files."""
    paths = [run_dir_or_files] if isinstance(run_dir_or_files, (str, os.PathLike)) else list(run_dir_or_files)
    return read_logs([os.fspath(p) for p in paths])


def verdicts(summary: NcclSummary, declared_fabric: str, host: str = "") -> List[str]:
    """One line per problem, naming the host(s) and the fix; empty when NCCL did what the fabric asks.

    `declared_fabric`: the cluster spec's network.fabric (ib, roce or ethernet). `host`: name the
    host this way instead of the names in the lines (the caller knows the node, e.g. by its IP).
    On ethernet, sockets on a real interface are the intended transport, and P2P/NVLS/SHM within one
    node are never a problem: neither gives a verdict."""
    fabric = (declared_fabric or "").strip().lower()
    if fabric not in FABRICS:
        raise KitError("unknown network fabric %r; use one of: %s" % (declared_fabric, ", ".join(FABRICS)))
    found: Dict[str, List[str]] = {}  # verdict template ({hosts} left open) -> hosts, in order
    for p in summary.processes:
        for template in _problems(p, fabric):
            _add(found.setdefault(template, []), host or p.where)
    return [template.format(hosts=", ".join(hosts)) for template, hosts in found.items()]


def _problems(p: ProcessNccl, fabric: str) -> List[str]:
    problems = []
    ib_disabled = p.env.get("NCCL_IB_DISABLE", "0") not in ("", "0")
    if fabric in RDMA_FABRICS and ib_disabled:
        problems.append(
            "NCCL_IB_DISABLE=%s is set on {hosts} while the cluster declares fabric %s: remove it" % (p.env["NCCL_IB_DISABLE"], fabric)
        )
    elif fabric in RDMA_FABRICS and p.uses_sockets and p.across_hosts:
        if p.ib_failed:
            problems.append(
                "NCCL fell back to sockets on {hosts}: IB did not initialise (no /dev/infiniband "
                "in the container, or NCCL_IB_DISABLE=1 in its environment?) — declared fabric %s: %s" % (fabric, RDMA_INTO_CONTAINER)
            )
        else:
            problems.append(
                "NCCL uses sockets on {hosts} though the cluster declares fabric %s (NCCL_NET=Socket, "
                "or NCCL_IB_HCA naming no HCA?): rerun with %s and read its NET/IB lines" % (fabric, NCCL_DEBUG_HINT)
            )
    loopback = [iface for iface, address in p.socket_ifaces if _is_loopback(iface, address)]
    if loopback and p.uses_sockets and p.across_hosts:
        ifname = p.env.get("NCCL_SOCKET_IFNAME")  # the usual cause: a setting meant for one machine
        problems.append(
            "NCCL uses sockets on the loopback interface %s on {hosts}%s: across hosts set "
            "NCCL_SOCKET_IFNAME to the cluster interface"
            % (", ".join(loopback), " (NCCL_SOCKET_IFNAME=%s there)" % ifname if ifname else "")
        )
    if p.env.get("NCCL_P2P_DISABLE", "0") not in ("", "0") and p.local_ranks > 1:
        problems.append(
            "NCCL_P2P_DISABLE=%s is set on {hosts}, which has %d GPUs in one communicator: they "
            "talk through host memory instead of NVLink/PCIe; remove it" % (p.env["NCCL_P2P_DISABLE"], p.local_ranks)
        )
    return problems


def transports_line(summary: NcclSummary) -> str:
    """One line for reports and progress, e.g. "NCCL 2.28.9: 16 channels NET/Socket (lo), 2 nodes"."""
    if not summary.lines:
        return "NCCL: no NCCL INFO lines (%s)" % NCCL_DEBUG_HINT
    versions = _unique(v.split("+")[0] for v in summary.versions)
    head = "NCCL %s" % "/".join(versions) if versions else "NCCL"
    channels = sorted(summary.channels().items(), key=lambda kv: (-kv[1], kv[0]))
    parts = []
    for i, (kind, n) in enumerate(channels):
        parts.append(("%d channels %s" if i == 0 else "%d %s") % (n, kind) + _bound(summary, kind))
    if not parts:
        networks = _unique(n for p in summary.processes for n in p.networks)
        parts.append("no channel lines" + (" (network %s)" % "/".join(networks) if networks else ""))
    nodes = summary.n_nodes()
    if nodes:
        parts.append("%d node%s" % (nodes, "" if nodes == 1 else "s"))
    line = "%s: %s" % (head, ", ".join(parts))
    if any(p.ib_failed for p in summary.processes):
        line += "; IB did not initialise"
    return line


def _bound(summary: NcclSummary, kind: str) -> str:
    """ " (lo)" after NET/Socket, " (mlx5_0:1/IB)" after NET/IB: what NCCL bound for that transport."""
    if kind == "NET/Socket":
        names = _unique(iface for p in summary.processes for iface, _ in p.socket_ifaces)
    elif kind == "NET/IB":
        names = _unique(device for p in summary.processes for device in p.ib_devices)
    else:
        return ""
    return " (%s)" % ", ".join(names) if names else ""


def _is_loopback(iface: str, address: str) -> bool:
    return iface == "lo" or address.startswith("127.") or address in ("::1", "[::1]")


def _add(items: list, item) -> None:
    if item not in items:
        items.append(item)


def _unique(items: Iterable[str]) -> List[str]:
    seen: List[str] = []
    for item in items:
        _add(seen, item)
    return seen
