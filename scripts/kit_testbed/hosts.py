"""The test bed: several real "hosts" on one machine (stdlib only; needs root, iproute2, util-linux, tini).

Each host is a mini-container:

* its own network namespace ``<prefix>-<name>`` with ``eth0`` (a veth into the private bridge
  ``<prefix>-br0``; the bridge has NO IP and the host has no default route, so nothing can leave);
* its own PID / mount / UTS / IPC namespaces (``unshare ... --fork --mount-proc``) with ``tini`` as
  PID 1 (it reaps daemonised Ray processes; killing it kills everything in the host);
* its own hostname, ``/tmp/ray`` (a bind mount of ``<state>/hosts/<name>/ray``, readable from
  outside for logs), ``/dev/shm`` (a private tmpfs) and ``/etc/hosts`` (a bind mount of a generated
  file mapping every host name to its IP, so Gloo's hostname-based interface choice is right);
* optionally (``mgmt``) a second NIC ``mgmt0`` on 192.168.77.0/24 (bridge ``<prefix>-br1``) that
  holds the host's DEFAULT ROUTE (via 192.168.77.254, which nobody owns): Ray's "default-route"
  IP guess then picks the wrong NIC, which tests use to prove node-IP selection by cluster CIDR.

Everything the test bed creates is named with its ``prefix`` (netns ``<prefix>-*``, links
``<prefix>-*``: bridges ``-br0``/``-br1``, veths ``-<host>``/``-m<host>``), so ``down`` finds and removes leftovers even without state
(after a crashed ``up`` or a killed test session).

A user's site (``site=True``): beside the cluster nodes, a CONTROLLER host ``ctl``
(a mini-container like the nodes, ``bed.controller``, NOT in ``bed.hosts``) on its own admin subnet
10.78.0.0/24 (bridge ``<prefix>-br2``), 10.78.0.2, and a ROUTER netns ``<prefix>-rtr`` (no processes,
``ip_forward=1``) with 10.77.0.254 on the cluster bridge and 10.78.0.1 on the admin bridge. Nodes get
``10.78.0.0/24 via 10.77.0.254``, the controller ``<cluster subnet> via 10.78.0.1``: the nodes see the
controller's own address (no NAT), and still nothing has a route out of the machine.

``cgroups=True`` re-mounts the machine's cgroup hierarchies inside every node host (``ip netns exec``
mounts a fresh sysfs, which hides them; dockerd refuses to start without them). Daemons on top
(dockerd per node, a registry on the controller): ``kit_testbed.site_layer``.

Library use::

    bed = Testbed.up(3, mgmt=["w2"])
    bed.exec("w1", "hostname").stdout          # -> "w1\\n"
    bed.down()

CLI: ``scripts/testbed`` (up / exec / status / down).

What runs on top of the hosts (Ray: ray_layer; a site's daemons: site_layer) registers a ``Layer``
with this module when imported: this core brings nothing up by itself, and shows and stops a layer
only through its hooks, so it never imports the modules built on it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    import argparse

REPO_ROOT = Path(__file__).resolve().parents[2]  # scripts/kit_testbed/ -> the checkout
DEFAULT_PREFIX = "akt"
DEFAULT_SUBNET = "10.77.0.0/24"
MGMT_SUBNET = "192.168.77.0/24"
MGMT_GATEWAY = "192.168.77.254"  # nobody owns it: a default route that leads nowhere
# The site's admin network (controller, registry): outside the cluster CIDR and the mgmt subnet.
ADMIN_SUBNET = "10.78.0.0/24"
ADMIN_ROUTER_IP = "10.78.0.1"  # the router's leg on the admin network
CONTROLLER_IP = "10.78.0.2"
CONTROLLER_NAME = "ctl"
DEFAULT_SHM = "2g"
# Mirrors alpa_job/cluster/cluster.yaml ranges.ephemeral (a real node pins it too: Gloo/NCCL bind
# ephemeral ports and the firewall opens only this range between members).
DEFAULT_EPHEMERAL = (40000, 49999)
STATE_FILE = "state.json"
REQUIRED_TOOLS = ("ip", "unshare", "nsenter", "tini", "mount")
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,5}$")


class TestbedError(RuntimeError):
    """A test-bed operation failed (message says what and how to recover)."""


def default_state_dir(prefix: str = DEFAULT_PREFIX) -> Path:
    return Path("/tmp") / f"{prefix}-testbed"


def missing_requirements() -> List[str]:
    """Why the test bed cannot run here ([] = it can)."""
    why = []
    if os.geteuid() != 0:
        why.append("not root (network/PID namespaces need root)")
    for tool in REQUIRED_TOOLS:
        if shutil.which(tool) is None:
            why.append(f"`{tool}` not found on PATH")
    return why


def host_names(n: int) -> List[str]:
    if n < 1:
        raise TestbedError("need at least 1 host")
    return ["head"] + [f"w{i}" for i in range(1, n)]


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise TestbedError(f"`{shlex.join(argv)}` failed (rc={p.returncode}): {p.stderr.strip()}")
    return p


# ---- processes and the machine's network, read from /proc and iproute2 (public: the layers use them) -----
def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    """Poll ``pred()`` until it returns something truthy and return that; TestbedError naming ``what``
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TestbedError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def pid_alive(pid: Optional[int]) -> bool:
    """Is ``pid`` a running process (a zombie or None counts as gone)?"""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def children_of(pid: int) -> List[int]:
    """The direct children of ``pid`` (e.g. what nsenter or unshare started inside a host)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def exe_of(pid: int) -> str:
    """The executable of ``pid`` ('' if gone): tells a daemon from a process that reused its PID."""
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def listening(pid: int, port: int) -> bool:
    """Does anything in the network namespace of ``pid`` listen on TCP ``port``? (reads /proc only:
    no process started, so it is cheap to poll)"""
    want = ":%04X" % port
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) > 3 and parts[1].endswith(want) and parts[3] == "0A":  # 0A = LISTEN
                        return True
        except OSError:
            pass
    return False


def python_env(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The caller's Python environment for commands run inside a host.

    PATH starts with the bin dir of the caller's interpreter (a venv's bin is NOT resolved through
    its symlink), VIRTUAL_ENV is set when there is one, PYTHONPATH starts with the repo root (so
    ``python -m alpa_job`` imports from this checkout), RAY_USAGE_STATS_ENABLED=0. Host-specific
    variables of the caller (HOSTNAME, RAY_ADDRESS) are dropped.
    """
    env = dict(os.environ if base is None else base)
    # Ray's auth variables too: an in-process ray.init() (a test, a notebook) leaves RAY_AUTH_MODE=token
    # in the caller's environment, and drivers that inherit it against an auth-off bed get actors that
    # die on start. The bed alone decides the mode (below, and exec_argv for an auth-on bed).
    for k in ("HOSTNAME", "RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):
        env.pop(k, None)
    venv = env.get("VIRTUAL_ENV")
    if not venv and sys.prefix != sys.base_prefix:
        venv = sys.prefix
    if not venv and (REPO_ROOT / ".venv" / "bin" / "python").exists():
        venv = str(REPO_ROOT / ".venv")
    bins = [os.path.dirname(sys.executable)]
    if venv:
        env["VIRTUAL_ENV"] = venv
        bins.insert(0, os.path.join(venv, "bin"))
    path = env.get("PATH") or "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    parts = [p for p in path.split(os.pathsep) if p]
    for b in reversed(bins):
        if b in parts:
            parts.remove(b)
        parts.insert(0, b)
    for sysdir in ("/usr/sbin", "/sbin"):  # nft, ip, sshd
        if sysdir not in parts:
            parts.append(sysdir)
    env["PATH"] = os.pathsep.join(parts)
    pp = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(pp)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray's log monitor lists its node's log folder ten times a second while it holds under this many files;
    # with several nodes on one machine's cores that polling is a noticeable share of the CPU. At 0 it lists
    # every 0.5 s (LOG_NAME_UPDATE_INTERVAL_S): a new worker's output reaches its driver at most that late.
    env.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
    # Ray starts its workers (the JAX processes) at nice 15, below everything else on a host. A real host has
    # nothing else that wants its cores; these hosts share one machine's with the rest of the test suite, so
    # at 15 the bed's training ran at a small fraction of a core whenever anything else was busy. At 0 they
    # compete as a dedicated host's would.
    env.setdefault("RAY_worker_niceness", "0")
    # Ray >= 2.59: `ray start --head` turns token auth on when ~/.ray/auth_token exists (any local
    # ray.init() on this machine writes one), but joining workers do not: they are then refused
    # ("InvalidAuthToken"). Every host shares /root, so pin the mode for the whole bed.
    env["RAY_AUTH_MODE"] = "disabled"
    return env


def _check_shape(n_hosts: int, subnet: str, mgmt: List[str], prefix: str, site: bool):
    """(host names, cluster network) of a bed of this shape, or TestbedError saying what to change."""
    if not _PREFIX_RE.match(prefix):
        raise TestbedError(f"prefix {prefix!r} must match {_PREFIX_RE.pattern} (interface names are <= 15 chars)")
    names = host_names(n_hosts)
    for m in mgmt:
        if m not in names:
            raise TestbedError(f"--mgmt {m!r} is not one of {names}")
    net = ipaddress.ip_network(subnet, strict=False)
    if net.num_addresses - 2 < n_hosts or n_hosts > 99:
        raise TestbedError(f"subnet {subnet} too small for {n_hosts} hosts (max 99 hosts)")
    if ipaddress.ip_network(MGMT_SUBNET).overlaps(net):
        raise TestbedError(f"subnet {subnet} overlaps the management subnet {MGMT_SUBNET}")
    if site and ipaddress.ip_network(ADMIN_SUBNET).overlaps(net):
        raise TestbedError(f"subnet {subnet} overlaps the site's admin subnet {ADMIN_SUBNET}; pick another --subnet")
    if site and n_hosts > net.num_addresses - 3:
        raise TestbedError(f"subnet {subnet} too small for {n_hosts} hosts plus the site's router")
    return names, net


# ---- layers: what other modules start on top of the hosts ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layer:
    """Something started on top of the hosts (Ray, a site's daemons), registered by the module that
    starts it (``register_layer``, on import). Every hook is optional; ``order`` is the bring-up
    position (lower first), teardown runs the other way round.

    The CLI (``scripts/testbed up``) uses the first five; this module uses the last three.
    """

    name: str  # also its key in ``up``'s JSON and in the bed's state
    order: int
    # its flags of `up` (an argument group)
    add_arguments: Optional[Callable[["argparse.ArgumentParser"], None]] = None
    # reject flags that make no sense (``usage_error(msg)`` exits) or a machine that lacks a tool (TestbedError)
    check_arguments: Optional[Callable[["argparse.Namespace", Callable[[str], None]], None]] = None
    # extra ``Testbed.up`` keywords its flags need (e.g. the site's controller)
    host_options: Optional[Callable[["argparse.Namespace"], dict]] = None
    # bring it up on a bed that is up (a reused bed keeps what it has)
    start: Optional[Callable[["Testbed", "argparse.Namespace"], None]] = None
    # after every layer started: add to ``up``'s JSON, return the exit code (0 = fine)
    report: Optional[Callable[["Testbed", "argparse.Namespace", dict], int]] = None
    # its entry in ``up``'s JSON (None: nothing to show)
    summary: Optional[Callable[["Testbed"], Optional[dict]]] = None
    # variables every command run in a host needs (e.g. Ray's auth token)
    exec_env: Optional[Callable[["Testbed"], Dict[str, str]]] = None
    # stop it before the hosts die: (bed, or None without state; prefix; graceful) -> what it did.
    # Never raises: what is left dies with the hosts.
    stop: Optional[Callable[[Optional["Testbed"], str, bool], List[str]]] = None


_LAYERS: Dict[str, Layer] = {}


def register_layer(layer: Layer) -> Layer:
    """Make ``layer`` known to the core and the CLI (a second registration of its name replaces the first)."""
    _LAYERS[layer.name] = layer
    return layer


def layers() -> List[Layer]:
    """The registered layers, in bring-up order."""
    return sorted(_LAYERS.values(), key=lambda layer: layer.order)


@dataclasses.dataclass
class Host:
    name: str
    ip: str
    netns: str
    mgmt_ip: Optional[str] = None
    pid: Optional[int] = None  # tini, PID 1 of the host (as seen from outside)
    launcher_pid: Optional[int] = None  # the `unshare` that forked tini

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items()}


class Testbed:
    """A running test bed (from ``Testbed.up`` or ``Testbed.load``)."""

    def __init__(
        self,
        state_dir: Path,
        prefix: str,
        subnet: str,
        hosts: List[Host],
        shm_size: str,
        ephemeral: Optional[Sequence[int]] = None,
        ray: Optional[dict] = None,
        controller: Optional[Host] = None,
        cgroups: bool = False,
        site: Optional[dict] = None,
    ):
        self.state_dir = Path(state_dir)
        self.prefix = prefix
        self.subnet = subnet
        self.hosts = hosts
        self.shm_size = shm_size
        self.ephemeral = list(ephemeral) if ephemeral else None
        self._launchers: Dict[str, subprocess.Popen] = {}
        # What ray_layer.start_ray started (address, auth token path, ...); None = no Ray.
        self.ray: Optional[dict] = ray
        self.controller = controller  # the site's controller host (admin subnet); not a cluster node
        self.cgroups = cgroups  # cgroup hierarchies re-mounted in every node host (dockerd)
        # What site_layer.start_site started (dockerd per node, registry, pushed image).
        self.site: Optional[dict] = site

    # ---- description -------------------------------------------------------------------------
    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def head_address(self) -> str:
        return f"{self.head.ip}:6379"

    @property
    def ips(self) -> Dict[str, str]:
        return {h.name: h.ip for h in self.hosts}

    @property
    def router_ip(self) -> Optional[str]:
        """The router's address on the cluster subnet (nodes route the admin subnet through it)."""
        return str(ipaddress.ip_network(self.subnet)[-2]) if self.controller else None

    def all_hosts(self) -> List[Host]:
        """Nodes, then the controller (if any): every mini-container of the bed."""
        return self.hosts + ([self.controller] if self.controller else [])

    def host(self, name: str) -> Host:
        for h in self.all_hosts():
            if h.name == name or h.ip == name:
                return h
        raise TestbedError(f"no host {name!r} in test bed {self.prefix!r} (have {[h.name for h in self.hosts]})")

    def host_dir(self, name: str) -> Path:
        return self.state_dir / "hosts" / self.host(name).name

    def ray_dir(self, name: str) -> Path:
        """The host's /tmp/ray, seen from outside (logs: ``<ray_dir>/session_*/logs``)."""
        return self.host_dir(name) / "ray"

    def to_json(self) -> dict:
        return {
            "prefix": self.prefix,
            "subnet": self.subnet,
            "shm_size": self.shm_size,
            "ephemeral": self.ephemeral,
            "state_dir": str(self.state_dir),
            "head_address": self.head_address,
            "hosts": [h.to_json() for h in self.hosts],
            "ray": self.ray,
            "controller": self.controller.to_json() if self.controller else None,
            "cgroups": self.cgroups,
            "site": self.site,
        }

    def summary(self) -> dict:
        """What ``scripts/testbed up`` prints."""
        hosts = []
        for h in self.hosts:
            d = {"name": h.name, "ip": h.ip}
            if h.mgmt_ip:
                d["mgmt_ip"] = h.mgmt_ip
            hosts.append(d)
        out = {"hosts": hosts, "head_address": self.head_address, "state_dir": str(self.state_dir)}
        if self.controller:
            out["controller"] = {
                "name": self.controller.name,
                "ip": self.controller.ip,
                "admin_subnet": ADMIN_SUBNET,
                "router": {"cluster_ip": self.router_ip, "admin_ip": ADMIN_ROUTER_IP},
            }
        for layer in layers():
            shown = layer.summary(self) if layer.summary else None
            if shown is not None:
                out[layer.name] = shown
        return out

    def status(self) -> dict:
        netns = set(list_netns())
        d = self.to_json()
        for hj, h in zip(d["hosts"], self.hosts):
            hj["alive"] = pid_alive(h.pid) and h.netns in netns
        d["up"] = all(hj["alive"] for hj in d["hosts"])
        if self.controller:
            d["controller"]["alive"] = pid_alive(self.controller.pid) and self.controller.netns in netns
            d["up"] = d["up"] and d["controller"]["alive"] and f"{self.prefix}-rtr" in netns
        return d

    def save(self):
        """Write the bed's state (atomically): what ``load``, ``status`` and ``down`` read, also after a
        crash. Layers call it after recording what they started."""
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        tmp.replace(self.state_dir / STATE_FILE)

    @classmethod
    def load(cls, state_dir: Optional[os.PathLike] = None, prefix: str = DEFAULT_PREFIX) -> "Testbed":
        sd = Path(state_dir) if state_dir else default_state_dir(prefix)
        try:
            d = json.loads((sd / STATE_FILE).read_text())
        except FileNotFoundError:
            raise TestbedError(f"no test bed state in {sd} (is it up? `scripts/testbed up --hosts N`)") from None
        hosts = [Host(**h) for h in d["hosts"]]
        ctl = Host(**d["controller"]) if d.get("controller") else None
        return cls(
            sd,
            d["prefix"],
            d["subnet"],
            hosts,
            d["shm_size"],
            d.get("ephemeral"),
            ray=d.get("ray"),
            controller=ctl,
            cgroups=bool(d.get("cgroups")),
            site=d.get("site"),
        )

    # ---- running commands in a host ----------------------------------------------------------
    def exec_argv(self, host: str, cmd: Sequence[str], env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> List[str]:
        """argv (run from outside) that runs ``cmd`` inside ``host`` with the caller's Python env."""
        h = self.host(host)
        if not pid_alive(h.pid):
            raise TestbedError(f"host {h.name} of test bed {self.prefix!r} is not running (PID 1 {h.pid} gone)")
        full_env = python_env()
        for layer in layers():  # e.g. Ray's token when auth is on: every client needs it
            if layer.exec_env:
                full_env.update(layer.exec_env(self))
        if env:
            full_env.update(env)
        wd = cwd or os.getcwd()
        return (
            ["nsenter", "-t", str(h.pid), "-n", "-m", "-u", "-i", "-p", f"--wd={wd}", "--", "env", "-i"]
            + [f"{k}={v}" for k, v in sorted(full_env.items())]
            + [str(c) for c in cmd]
        )

    def exec(
        self,
        host: str,
        *cmd,
        timeout: float = 120,
        check: bool = True,
        env: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
        input: Optional[str] = None,
        capture: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside ``host``; text output captured. Raises CalledProcessError if check and rc != 0."""
        if len(cmd) == 1 and isinstance(cmd[0], (list, tuple)):
            cmd = tuple(cmd[0])
        argv = self.exec_argv(host, cmd, env=env, cwd=cwd)
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE) if capture else {}
        p = subprocess.run(argv, text=True, timeout=timeout, input=input, stdin=None if input is not None else subprocess.DEVNULL, **kw)
        p.args = list(cmd)
        if check and p.returncode != 0:
            raise subprocess.CalledProcessError(p.returncode, f"[{host}] {shlex.join(map(str, cmd))}", p.stdout, p.stderr)
        return p

    def popen(self, host: str, *cmd, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None, **popen_kw) -> subprocess.Popen:
        """Start ``cmd`` inside ``host`` in the background (Popen kwargs pass through; stdin defaults to /dev/null)."""
        if len(cmd) == 1 and isinstance(cmd[0], (list, tuple)):
            cmd = tuple(cmd[0])
        popen_kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.exec_argv(host, cmd, env=env, cwd=cwd), **popen_kw)

    # ---- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def up(
        cls,
        n_hosts: int,
        subnet: str = DEFAULT_SUBNET,
        mgmt: Iterable[str] = (),
        state_dir: Optional[os.PathLike] = None,
        prefix: str = DEFAULT_PREFIX,
        shm_size: str = DEFAULT_SHM,
        ephemeral: Optional[Sequence[int]] = DEFAULT_EPHEMERAL,
        reuse: bool = False,
        timeout: float = 20,
        site: bool = False,
        cgroups: bool = False,
    ) -> "Testbed":
        """Create ``n_hosts`` hosts (head, w1, w2, ...); with ``site`` also the controller ``ctl`` on the
        admin subnet and the router between the two networks; with ``cgroups`` the cgroup hierarchies
        re-mounted in every node host (needed by dockerd).

        If anything of ``prefix`` already exists: with ``reuse`` a healthy test bed of the same
        shape is returned as is (anything else is torn down and rebuilt); without it TestbedError.
        """
        why = missing_requirements()
        if why:
            raise TestbedError("test bed unavailable: " + "; ".join(why))
        mgmt = list(mgmt)
        names, net = _check_shape(n_hosts, subnet, mgmt, prefix, site)
        sd = Path(state_dir) if state_dir else default_state_dir(prefix)
        leftovers = _leftovers(prefix, sd)
        if leftovers:
            if not reuse:
                raise TestbedError(
                    f"test bed {prefix!r} already (partly) up: {', '.join(leftovers)}; run `scripts/testbed down` first (or `up --reuse`)"
                )
            bed = cls._healthy_of_shape(sd, names, net, mgmt, site, cgroups)
            if bed is not None:
                return bed
            down(state_dir=sd, prefix=prefix)

        hosts_ips = list(net.hosts())
        mnet = list(ipaddress.ip_network(MGMT_SUBNET).hosts())
        hosts = [
            Host(name=n, ip=str(hosts_ips[i]), netns=f"{prefix}-{n}", mgmt_ip=str(mnet[i]) if n in mgmt else None)
            for i, n in enumerate(names)
        ]
        ctl = Host(name=CONTROLLER_NAME, ip=CONTROLLER_IP, netns=f"{prefix}-{CONTROLLER_NAME}") if site else None
        bed = cls(sd, prefix, str(net), hosts, shm_size, ephemeral, controller=ctl, cgroups=bool(cgroups))
        try:
            bed._create(timeout)
        except BaseException:
            try:
                bed.down()
            except Exception as e:  # keep the original error
                print(f"testbed: cleanup after failed up also failed: {e}", file=sys.stderr)
            raise
        return bed

    @classmethod
    def _healthy_of_shape(cls, sd: Path, names: List[str], net, mgmt: List[str], site: bool, cgroups: bool) -> Optional["Testbed"]:
        """The bed in ``sd`` if it is up and has this shape (``up --reuse`` keeps it), else None."""
        try:
            bed = cls.load(sd)
            st = bed.status()
        except TestbedError:
            return None
        same = (
            [h.name for h in bed.hosts] == names
            and bed.subnet == str(net)
            and sorted(h.name for h in bed.hosts if h.mgmt_ip) == sorted(mgmt)
            and bool(bed.controller) == bool(site)
            and bed.cgroups == bool(cgroups)
        )
        return bed if st["up"] and same else None

    def _create(self, timeout: float):
        p = self.prefix
        sd = self.state_dir
        (sd / "hosts").mkdir(parents=True, exist_ok=True)
        self.save()  # first, so `down` finds the state even if we die half-way
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{h.ip}\t{h.name}" for h in self.hosts]
        lines += [f"{h.mgmt_ip}\t{h.name}-mgmt" for h in self.hosts if h.mgmt_ip]
        if self.controller:
            lines.append(f"{self.controller.ip}\t{self.controller.name}")
        (sd / "hosts.txt").write_text("\n".join(lines) + "\n")
        plen = ipaddress.ip_network(self.subnet).prefixlen
        mplen = ipaddress.ip_network(MGMT_SUBNET).prefixlen

        br0 = f"{p}-br0"
        _run(["ip", "link", "add", br0, "type", "bridge"])
        _run(["ip", "link", "set", br0, "up"])
        if any(h.mgmt_ip for h in self.hosts):
            br1 = f"{p}-br1"
            _run(["ip", "link", "add", br1, "type", "bridge"])
            _run(["ip", "link", "set", br1, "up"])
        for h in self.hosts:
            ns = h.netns
            _run(["ip", "netns", "add", ns])
            veth = f"{p}-{h.name}"
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", br0, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{h.ip}/{plen}", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if h.mgmt_ip:
                mveth = f"{p}-m{h.name}"
                _run(["ip", "link", "add", mveth, "type", "veth", "peer", "name", "mgmt0", "netns", ns])
                _run(["ip", "link", "set", mveth, "master", f"{p}-br1", "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{h.mgmt_ip}/{mplen}", "dev", "mgmt0"])
                _run(["ip", "-n", ns, "link", "set", "mgmt0", "up"])
                _run(["ip", "-n", ns, "route", "add", "default", "via", MGMT_GATEWAY, "dev", "mgmt0"])
            if self.ephemeral:
                lo, hi = self.ephemeral
                _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.ip_local_port_range={lo} {hi}"])
            if self.controller:
                _run(["ip", "-n", ns, "route", "add", ADMIN_SUBNET, "via", self.router_ip, "dev", "eth0"])
            self._start_init(h, cgroups=self.cgroups)
        if self.controller:
            self._create_site_network(plen)
            self._start_init(self.controller)
        self.save()
        for h in self.all_hosts():
            self._wait_init(h, timeout)
        self.save()

    def _create_site_network(self, plen: int):
        """The admin bridge, the router netns (forwarding, no default route) and the controller's NIC."""
        p = self.prefix
        aplen = ipaddress.ip_network(ADMIN_SUBNET).prefixlen
        br2, rtr, ctl = f"{p}-br2", f"{p}-rtr", self.controller
        _run(["ip", "link", "add", br2, "type", "bridge"])
        _run(["ip", "link", "set", br2, "up"])
        _run(["ip", "netns", "add", rtr])
        for veth, bridge, nic, addr in (
            (f"{p}-rtr", f"{p}-br0", "eth0", f"{self.router_ip}/{plen}"),
            (f"{p}-rtra", br2, "eth1", f"{ADMIN_ROUTER_IP}/{aplen}"),
        ):
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", nic, "netns", rtr])
            _run(["ip", "link", "set", veth, "master", bridge, "up"])
            _run(["ip", "-n", rtr, "addr", "add", addr, "dev", nic])
            _run(["ip", "-n", rtr, "link", "set", nic, "up"])
        _run(["ip", "-n", rtr, "link", "set", "lo", "up"])
        _run(["ip", "netns", "exec", rtr, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        _run(["ip", "netns", "add", ctl.netns])
        veth = f"{p}-{ctl.name}"
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ctl.netns])
        _run(["ip", "link", "set", veth, "master", br2, "up"])
        _run(["ip", "-n", ctl.netns, "addr", "add", f"{ctl.ip}/{aplen}", "dev", "eth0"])
        _run(["ip", "-n", ctl.netns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ctl.netns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ctl.netns, "route", "add", self.subnet, "via", ADMIN_ROUTER_IP, "dev", "eth0"])

    def _start_init(self, h: Host, cgroups: bool = False):
        hd = self.host_dir(h.name)
        (hd / "ray").mkdir(parents=True, exist_ok=True)
        q = shlex.quote
        script = "\n".join(
            [
                "set -eu",
                f"hostname {q(h.name)}",
                "mkdir -p /tmp/ray",
                f"mount --bind {q(str(hd / 'ray'))} /tmp/ray",
                f"mount -t tmpfs -o size={q(self.shm_size)},mode=1777 tmpfs /dev/shm",
                f"mount --bind {q(str(self.state_dir / 'hosts.txt'))} /etc/hosts",
                *(cgroup_mount_lines() if cgroups else []),
                "exec tini -s -- sleep infinity",
            ]
        )
        log = open(hd / "init.log", "wb")
        try:
            # `ip netns exec` execs (no fork) into unshare, so Popen.pid is the unshare; its only
            # child is PID 1 of the host (bash, then tini). A new session: no SIGHUP from our tty.
            proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    h.netns,
                    "unshare",
                    "--mount",
                    "--uts",
                    "--ipc",
                    "--pid",
                    "--fork",
                    "--mount-proc",
                    "--propagation",
                    "private",
                    "bash",
                    "-c",
                    script,
                    f"{self.prefix}-init-{h.name}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self._launchers[h.name] = proc
        h.launcher_pid = proc.pid

    def _wait_init(self, h: Host, timeout: float):
        tini = os.path.realpath(shutil.which("tini") or "/usr/bin/tini")
        proc = self._launchers[h.name]

        def ready():
            if proc.poll() is not None:
                log = (self.host_dir(h.name) / "init.log").read_text(errors="replace").strip()
                raise TestbedError(f"host {h.name}: init exited (rc={proc.returncode}): {log}")
            for c in children_of(proc.pid):
                if os.path.realpath(exe_of(c)) == tini:
                    return c
            return None

        h.pid = wait_for(ready, timeout, f"host {h.name}'s tini (PID 1) to start")

    def revive(self, timeout: float = 20) -> List[str]:
        """Start PID 1 again in every host whose PID 1 died while its network namespace stayed (a test
        killed the host): the same name, addresses, mounts and firewall (nftables and sysctls live in the
        network namespace), nothing running in it. Returns the names of the hosts revived."""
        netns = set(list_netns())
        dead = [h for h in self.all_hosts() if not pid_alive(h.pid) and h.netns in netns]
        for h in dead:
            self._start_init(h, cgroups=self.cgroups and h is not self.controller)
        for h in dead:
            self._wait_init(h, timeout)
        if dead:
            self.save()
        return [h.name for h in dead]

    def down(self, timeout: float = 20, graceful: bool = True):
        return down(state_dir=self.state_dir, prefix=self.prefix, timeout=timeout, graceful=graceful, _launchers=self._launchers)


def host_pids(host_pid: int) -> List[int]:
    """Every process (seen from outside) in the PID namespace whose PID 1 is ``host_pid``: one host's processes."""
    try:
        ns = os.readlink(f"/proc/{host_pid}/ns/pid")
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                    pids.append(int(entry))
            except OSError:
                continue  # it ended while we looked
    return pids


class QuotaGroup:
    """A CPU cgroup of ``cores`` CPUs' worth of time (cgroup v1's `cpu` hierarchy, or v2), made on enter and
    removed on exit (its processes must have left it by then: each ends, or goes back to ``.root``)."""

    def __init__(self, name: str, cores: float, period_us: int = 100_000):
        v1 = Path("/sys/fs/cgroup/cpu")
        self.root = v1 if (v1 / "cpu.cfs_quota_us").exists() else Path("/sys/fs/cgroup")
        self.path = self.root / name
        self.procs = self.path / "cgroup.procs"  # write a PID here to put that process in the group
        self.cores, self.period_us = cores, period_us

    def __enter__(self) -> "QuotaGroup":
        if self.root == Path("/sys/fs/cgroup"):  # cgroup v2: the cpu controller handed down to child groups
            control = self.root / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
        self.path.mkdir(exist_ok=True)
        self.set_cores(self.cores)
        return self

    def set_cores(self, cores: float) -> None:
        """Change the group's share while its processes run (the kernel applies it from the next period)."""
        self.cores = cores
        quota = max(1000, int(cores * self.period_us))
        if (self.path / "cpu.cfs_quota_us").exists():
            (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} {self.period_us}")

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # a process still leaving keeps the group busy for a moment
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)

    def throttling(self) -> Dict[str, float]:
        """How often and how long the quota held the group back so far: {"periods", "throttled", "seconds"}."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line.strip())
        seconds = int(stat["throttled_time"]) / 1e9 if "throttled_time" in stat else int(stat["throttled_usec"]) / 1e6
        return {"periods": int(stat["nr_periods"]), "throttled": int(stat["nr_throttled"]), "seconds": seconds}


class CpuQuota:
    """A host slowed on purpose: every process of it (and every one they start later, which inherit it) in a
    QuotaGroup of ``cores`` CPUs' worth of time. ``with CpuQuota(bed, "w1", 0.25): ...``; on exit the processes
    go back to the machine's root group and the group is removed."""

    def __init__(self, bed: "Testbed", host: str, cores: float, period_us: int = 100_000):
        self.bed, self.host = bed, host
        self.group = QuotaGroup(f"{bed.prefix}-{host}-quota", cores, period_us)

    def __enter__(self) -> "CpuQuota":
        self.group.__enter__()
        moved, error = self._move(self.group.procs)
        if not moved:  # a slowdown that never happened must not pass for one that was not seen
            raise TestbedError(f"could not put any process of host {self.host} into {self.group.path}: {error}")
        self.throttled: Dict[str, float] = {}
        return self

    def __exit__(self, *exc) -> None:
        self.throttled = self.group.throttling()
        self._move(self.group.root / "cgroup.procs")
        self.group.__exit__(*exc)

    def throttling(self) -> Dict[str, float]:
        return self.group.throttling()

    def set_cores(self, cores: float) -> None:
        self.group.set_cores(cores)

    def _move(self, procs: Path) -> Tuple[int, str]:
        moved, error = 0, "the host has no processes"
        for pid in host_pids(self.bed.host(self.host).pid):
            try:
                procs.write_text(str(pid))
                moved += 1
            except OSError as e:
                error = f"pid {pid}: {e}"  # it ended, or is a kernel thread
        return moved, error


def cgroup_mount_lines(mountinfo: str = "/proc/self/mountinfo") -> List[str]:
    """Shell lines that mount, inside a host, the same cgroup hierarchies the machine has.

    Read from the machine's own mount table (cgroup v1 + unified here; a pure cgroup v2 machine gives
    one cgroup2 line), so the superblocks are the machine's: dockerd's cgroupfs driver then works.
    """
    lines, root_tmpfs = [], False
    with open(mountinfo) as f:
        for line in f:
            pre, post = line.split(" - ", 1)
            mp = pre.split()[4]
            fstype, _src, sopts = (post.split() + ["", ""])[:3]
            if not (mp == "/sys/fs/cgroup" or mp.startswith("/sys/fs/cgroup/")):
                continue
            if mp == "/sys/fs/cgroup" and fstype == "tmpfs":
                root_tmpfs = True
                continue
            if fstype == "cgroup":
                opts = ",".join(o for o in sopts.split(",") if o not in ("rw", "ro"))
                lines.append(f"mkdir -p {mp} && mount -t cgroup -o {shlex.quote(opts)} cgroup {mp}")
            elif fstype == "cgroup2":
                lines.append(f"mkdir -p {mp} && mount -t cgroup2 cgroup2 {mp}")
    if root_tmpfs:
        lines.insert(0, "mount -t tmpfs -o mode=755,nosuid,nodev,noexec tmpfs /sys/fs/cgroup")
    if not lines:
        raise TestbedError("the machine has no cgroup mounts under /sys/fs/cgroup to repeat inside the hosts")
    return lines


# ---- discovery / teardown (works without state) ------------------------------------------------
def list_netns() -> List[str]:
    """Every named network namespace on the machine."""
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def list_links() -> List[str]:
    """Every network interface in the machine's own namespace (veth ends without their ``@peer``)."""
    p = _run(["ip", "-o", "link", "show"], check=False)
    out = []
    for line in p.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            out.append(parts[1].strip().split("@")[0])
    return out


def _ours(name: str, prefix: str) -> bool:
    return name.startswith(f"{prefix}-")


def mounts_under(paths: Sequence[str]) -> List[str]:
    """The machine's mount points at or below any of ``paths``, in mount order (unmount them reversed)."""
    out = []
    with open("/proc/mounts") as f:
        for line in f:
            mp = line.split()[1].replace("\\040", " ")
            if any(mp == p or mp.startswith(p.rstrip("/") + "/") for p in paths):
                out.append(mp)
    return out


def cmdline_of(pid: int) -> bytes:
    """The raw command line of ``pid`` (arguments NUL-separated; b'' if gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _procs_matching(needle: str) -> List[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    out.append(int(d))
        except OSError:
            pass
    return out


def _leftovers(prefix: str, state_dir: Path) -> List[str]:
    found = [f"netns {n}" for n in list_netns() if _ours(n, prefix)]
    found += [f"link {n}" for n in list_links() if _ours(n, prefix)]
    if (state_dir / STATE_FILE).exists():
        found.append(f"state {state_dir / STATE_FILE}")
    return found


def list_prefixes(pattern: str = r"akt[a-z0-9]*") -> List[str]:
    """Prefixes of every test bed (or leftover) on this machine whose prefix fully matches ``pattern``."""
    rx = re.compile(pattern)
    names = list_netns() + [n for n in list_links() if n.endswith(("-br0", "-br1", "-br2"))]
    return sorted({n.rsplit("-", 1)[0] for n in names if "-" in n and rx.fullmatch(n.rsplit("-", 1)[0])})


def down(
    state_dir: Optional[os.PathLike] = None,
    prefix: Optional[str] = None,
    timeout: float = 20,
    graceful: bool = True,
    _launchers: Optional[Dict[str, subprocess.Popen]] = None,
) -> List[str]:
    """Remove a test bed and its leftovers; idempotent. Returns what it removed (for logs).

    Order: every registered layer's ``stop`` hook, last brought up first (Ray's ``ray stop`` in every
    host only when ``graceful``; the site's daemons by PID); then SIGKILL every process in each host
    (PID 1 first: its PID namespace dies with it; then anything still in the host's netns), wait until
    gone, delete netns (and with it the veth pairs), bridges, the generated files and the state dir.
    The hosts' mounts live in their own private mount namespaces and vanish with their last process.
    """
    bed, prefix, sd = _find_bed(state_dir, prefix)
    done: List[str] = []
    for layer in reversed(layers()):  # cleanly (what is left is killed below with the hosts anyway)
        if layer.stop:
            done += layer.stop(bed, prefix, graceful)
    netns = [n for n in list_netns() if _ours(n, prefix)]
    _kill_processes(bed, prefix, netns, list((_launchers or {}).values()), timeout, done)
    done += _remove_network(prefix, sd, netns, timeout)
    done += _remove_state(sd)
    return done


def _find_bed(state_dir: Optional[os.PathLike], prefix: Optional[str]):
    """(the bed its state describes, or None; its prefix; its state dir): ``down`` works without state."""
    sd = Path(state_dir) if state_dir else (default_state_dir(prefix) if prefix else None)
    bed = None
    if sd and (sd / STATE_FILE).exists():
        try:
            bed = Testbed.load(sd)
            prefix = prefix or bed.prefix
        except (TestbedError, ValueError, KeyError, TypeError):
            bed = None
    prefix = prefix or DEFAULT_PREFIX
    return bed, prefix, sd or default_state_dir(prefix)


def _kill_processes(
    bed: Optional[Testbed], prefix: str, netns: List[str], procs: List[subprocess.Popen], timeout: float, done: List[str]
) -> None:
    """SIGKILL every process of the bed and wait until all are gone (``done`` gets a line per PID)."""
    pids = set()
    tini = os.path.realpath(shutil.which("tini") or "/usr/bin/tini")
    if bed:  # only if still tini: a stale state file must not make us kill a reused PID
        pids |= {h.pid for h in bed.all_hosts() if h.pid and os.path.realpath(exe_of(h.pid)) == tini}
    ns_pids = set()
    for ns in netns:
        p = _run(["ip", "netns", "pids", ns], check=False)
        ns_pids |= {int(x) for x in p.stdout.split() if x.isdigit()}
    init_tag = f"{prefix}-init-"
    launchers = set(_procs_matching(init_tag))  # each host's `unshare` (and a bash not yet exec'd to tini)
    launchers |= {
        h.launcher_pid for h in (bed.all_hosts() if bed else []) if h.launcher_pid and init_tag.encode() in cmdline_of(h.launcher_pid)
    }

    # PID 1 first (its PID namespace dies with it), then anything else in the netns. The launchers
    # exit by themselves once their tini is gone (and reap it: no zombie tini); kill only stragglers.
    _kill_all((pids | ns_pids) - launchers, done)
    deadline = time.monotonic() + min(5.0, timeout)
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    try:
        wait_for(lambda: not any(pid_alive(p) for p in launchers), max(0.1, deadline - time.monotonic()), "")
    except TestbedError:
        pass
    _kill_all(launchers, done)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    all_pids = pids | ns_pids | launchers
    wait_for(lambda: not any(pid_alive(p) for p in all_pids), timeout, f"test bed {prefix!r} processes to exit")


def _kill_all(targets, done: List[str]) -> None:
    for pid in sorted(targets):
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                if f"pid {pid}" not in done:
                    done.append(f"pid {pid}")
            except ProcessLookupError:
                pass


def _remove_network(prefix: str, sd: Path, netns: List[str], timeout: float) -> List[str]:
    """Netns, links (veths first, then the bridges) and mounts of the bed; veths die with their netns,
    their root-side ends are deleted explicitly anyway."""
    done = []
    for ns in netns:
        _run(["ip", "netns", "del", ns], check=False)
        done.append(f"netns {ns}")
    for link in list_links():
        if _ours(link, prefix) and not link.endswith(("-br0", "-br1", "-br2")):
            _run(["ip", "link", "del", link], check=False)
            done.append(f"link {link}")
    for link in list_links():
        if _ours(link, prefix):
            _run(["ip", "link", "del", link], check=False)
            done.append(f"link {link}")
    for m in reversed(mounts_under([f"/run/netns/{prefix}-", str(sd)])):
        _run(["umount", "-l", m], check=False)
        done.append(f"mount {m}")
    wait_for(lambda: not [n for n in list_netns() if _ours(n, prefix)], timeout, f"netns {prefix}-* to go")
    return done


def _remove_state(sd: Path) -> List[str]:
    if not sd.exists():
        return []
    if not ((sd / STATE_FILE).exists() or (sd / "hosts").exists()):
        raise TestbedError(f"refusing to delete {sd}: not a test-bed state dir")
    shutil.rmtree(sd, ignore_errors=True)
    return [f"state {sd}"]
