"""pytest fixtures for the multi-host test bed (scripts/kit_testbed/) and a Ray cluster on it.

Fixtures (all session-scoped):

* ``testbed_factory(hosts=3, mgmt=(), shm_size="2g", tag="", site=False, cgroups=False, held=False)`` ->
  ``Testbed``: one test bed per distinct shape, created on first request, shared by every test
  that asks for that shape, torn down once no test left in the run needs it (pytest_runtest_teardown
  below; ``held``: a fixture's bed, which ends with that fixture) or at session end (also after
  failures). Skips the test with the reason when not root or ip / unshare / nsenter / tini are missing.
* ``testbed``: the shared bed: 3 hosts head/w1/w2 on 10.77.0.0/24, w2 with a management NIC
  (192.168.77.3) holding its default route. Nothing else is loaded in it (no firewall, no Ray):
  tests that start things in it must stop them.
* ``ray_cluster`` -> ``RayCluster``: its OWN 3-host bed (so ``testbed`` stays bare), brought up by
  the one bring-up ``kit_testbed.ray_layer.start_ray`` (the same as ``scripts/testbed up --ray`` and
  bench/testbed_bringup.py): the spec's nftables firewall in each host, Ray head + 2 workers started
  with ``alpa_job.cluster.ray_start.ray_start_args``, waited for with ``alpa_job.cluster.wait_nodes``;
  then formation checked (3 nodes alive at the bed's IPs, a task pinned to each node returns that
  node's IP). ``bed.ray`` holds what start_ray recorded (address, spec path, seconds per step).

* ``site_bed`` -> ``SiteBed``: a user's site on its OWN bed (tag "site"): 3 node hosts
  head/w1/w2 (10.77.0.1-3, cluster CIDR 10.77.0.0/24), a CONTROLLER ``ctl`` at 10.78.0.2 on the admin
  subnet 10.78.0.0/24 (not in the cluster CIDR; a router netns 10.77.0.254 | 10.78.0.1 joins the two;
  nodes route 10.78.0.0/24 back through it; nothing routes out of the machine), sshd in every node
  (root, key only; the controller is the client), dockerd in every node (by PID), Debian's
  docker-registry on the controller at 10.78.0.2:5000 (every dockerd: --insecure-registry), and the
  modern CPU image (spec ``images.jax_cpu``) pushed there (built first if the image cache lacks it).
  No image is pulled, no container runs, no firewall or Ray is loaded: that is the caller's job
  (tests that pull/run must remove what they made). Torn down at session end: containers removed,
  dockerds and the registry SIGTERMed by PID, hosts removed. See ``SiteBed`` for the API.

``Testbed``: ``.hosts`` (list of Host: ``.name``, ``.ip``, ``.mgmt_ip``, ``.netns``, ``.pid``),
``.ips`` {name: ip}, ``.head``, ``.head_address``, ``.host(name)``, ``.ray_dir(name)`` (the host's
/tmp/ray from outside: logs), ``.exec(host, *cmd, timeout=120, check=True, env=None, cwd=None,
input=None)`` -> CompletedProcess (text stdout/stderr), ``.popen(host, *cmd, env=None, **popen_kw)``
-> Popen, ``.exec_argv(host, cmd)``. Commands run with the caller's venv on PATH, PYTHONPATH = repo.

Parallel pytest sessions on one machine are serialised by a lock (``/run/lock/<prefix>-testbed.lock``,
wait up to $AKT_TESTBED_LOCK_TIMEOUT s, default 900). Prefix: $AKT_TESTBED_PREFIX (default ``aktp``;
the CLI's default is ``akt``, so a bed you brought up by hand is left alone). Leftovers of a killed
session with the same prefix are removed at the start of the next one.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional

import pytest

from kit_testbed import hosts as testbed_lib
from kit_testbed import ray_layer as testbed_ray
from kit_testbed import site_layer as testbed_site
from kit_testbed.hosts import Testbed, TestbedError  # noqa: F401
from kit_testbed.site_bed import SiteBed

PREFIX = os.environ.get("AKT_TESTBED_PREFIX", "aktp")
LOCK_TIMEOUT = float(os.environ.get("AKT_TESTBED_LOCK_TIMEOUT", "900"))


class _Beds:
    """The session's test beds, keyed by shape; holds the machine-wide lock while any exists."""

    def __init__(self):
        self.beds: Dict[tuple, Testbed] = {}
        self.lock_fd: Optional[int] = None
        self.asked_by: Dict[tuple, set] = {}  # bed key -> the test modules that asked for it

    def _lock(self):
        if self.lock_fd is not None:
            return
        os.makedirs("/run/lock", exist_ok=True)
        fd = os.open(f"/run/lock/{PREFIX}-testbed.lock", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    pytest.fail(f"test bed lock /run/lock/{PREFIX}-testbed.lock held by another session for more than {LOCK_TIMEOUT:.0f}s")
                time.sleep(0.5)
        self.lock_fd = fd
        # Leftovers of a killed session (same prefix family): nobody else can own them now.
        for p in testbed_lib.list_prefixes(rf"{PREFIX}\d*"):
            testbed_lib.down(prefix=p)

    def get(
        self,
        hosts: int,
        mgmt=(),
        shm_size: str = testbed_lib.DEFAULT_SHM,
        tag: str = "",
        site: bool = False,
        cgroups: bool = False,
        held: bool = False,
        revive: bool = False,
    ) -> Testbed:
        why = testbed_lib.missing_requirements()
        if why:
            pytest.skip("multi-host test bed unavailable: " + "; ".join(why))
        key = (hosts, tuple(sorted(mgmt)), shm_size, tag, site, cgroups)
        shape = dict(mgmt=mgmt, shm_size=shm_size, site=site, cgroups=cgroups)
        if not held and _running_module[0]:  # a fixture's bed ends with the fixture (BED_FIXTURES)
            self.asked_by.setdefault(key, set()).add(_running_module[0])
        bed = self.beds.get(key)
        # `revive`: a host a test killed is started anew in place (Testbed.revive; what ran in it is the
        # caller's to start again) instead of the whole bed being rebuilt.
        if bed is not None and not bed.status()["up"] and not (revive and bed.revive() and bed.status()["up"]):
            # torn down (ray_cluster's, or released) or broken: rebuild
            bed.down()
            self.beds[key] = bed = Testbed.up(hosts, prefix=bed.prefix, **shape)
        if bed is None:
            self._lock()
            prefix = PREFIX if not self.beds else f"{PREFIX}{len(self.beds)}"
            bed = Testbed.up(hosts, prefix=prefix, **shape)
            self.beds[key] = bed
        return bed

    def release_unless(self, keep) -> None:
        """Take down every bed asked for only by modules for which `keep(module)` is false: a bed's Ray or
        Docker daemons left idle for the rest of the session would take the two cores' time from the tests
        still running. A test that asks for a released bed again gets it rebuilt (get)."""
        for key, bed in list(self.beds.items()):
            users = self.asked_by.get(key)
            if users and not any(keep(module) for module in users):
                bed.down()
                del self.asked_by[key]

    def close(self):
        errors = []
        for bed in self.beds.values():
            try:
                bed.down()
            except Exception as e:  # tear down the others anyway
                errors.append(f"{bed.prefix}: {e}")
        self.beds.clear()
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None
        if errors:
            raise TestbedError("test bed teardown failed: " + "; ".join(errors))


_running_module = [""]  # the module of the test running now (which tests asked for which bed)
_session_beds: list = []  # the session's _Beds, once testbed_factory made it


@pytest.fixture(scope="session")
def testbed_factory():
    beds = _Beds()
    _session_beds.append(beds)
    try:
        yield beds.get
    finally:
        _session_beds.clear()
        beds.close()


# ---- beds end with their last user -------------------------------------------------------------------
# The fixtures that hold a bed and its daemons for the session. Each is finished (its own teardown runs)
# once no test left in this run asks for it; pytest makes it anew for a later test that does.
BED_FIXTURES = ("ray_cluster", "mgmt_cluster", "ssh_bed", "site_bed", "testbed")


def pytest_runtest_setup(item):
    _running_module[0] = item.module.__name__


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """At the end of a module: finish the bed fixtures no later test of the run asks for, and take down the
    beds a test asked testbed_factory for directly once neither a later test of their modules nor the next
    module (which may reuse them through those modules, as the preemption tests use node loss's) is left."""
    if nextitem is not None and nextitem.module is item.module:
        return
    items = item.session.items
    later = items[items.index(item) + 1 :]
    wanted = set().union(*(other.fixturenames for other in later))
    manager = item.session._fixturemanager
    for name in BED_FIXTURES:
        for definition in manager.getfixturedefs(name, item) or ():
            if name not in wanted and definition.cached_result is not None:
                definition.finish(item._request)
    if _session_beds:
        later_modules = {other.module.__name__ for other in later}
        next_source = Path(nextitem.module.__file__).read_text() if nextitem is not None else ""
        _session_beds[0].release_unless(lambda module: module in later_modules or module in next_source)


@pytest.fixture(scope="session")
def testbed(testbed_factory) -> Testbed:
    return testbed_factory(3, mgmt=("w2",), held=True)


# ---- Ray on the test bed ---------------------------------------------------------------------------
RAY_NUM_CPUS = 2
RAY_OBJECT_STORE = 200_000_000
RAY_FORM_TIMEOUT = 90
RAY_START_TIMEOUT = testbed_ray.DEFAULT_TIMEOUT  # start_ray's whole budget (late join + one restart included)

_CHECK_DRIVER = r"""
import json, os, socket, sys, time
import ray
from alpa_job.cluster import ray_api
from alpa_job.cluster.wait_nodes import wait_for_alive
want, timeout = json.loads(sys.argv[1]), float(sys.argv[2])
t0 = time.monotonic()
ray_api.join_ray(os.environ["RAY_ADDRESS"], timeout, log_to_driver=False)
alive = sorted(n.ip for n in wait_for_alive(len(want), timeout))

@ray.remote(num_cpus=0)
def where():
    return ray.util.get_node_ip_address(), socket.gethostname()

pinned = {}
if sorted(alive) == sorted(want):
    refs = {ip: where.options(**ray_api.pin_to_node(ip)).remote() for ip in want}
    left = max(5.0, timeout - (time.monotonic() - t0))
    for ip, ref in refs.items():
        try:
            pinned[ip] = list(ray.get(ref, timeout=left))
        except Exception as e:
            pinned[ip] = ["error", repr(e)]
print("RESULT " + json.dumps({"alive": alive, "pinned": pinned}))
"""


class RayCluster:
    """A Ray cluster (head + workers) on its own test bed.

    ``.testbed``, ``.spec`` (ClusterSpec), ``.spec_path``, ``.address`` ("10.77.0.1:6379"),
    ``.head_ip``, ``.node_ips`` {host name: ip}, ``.formation`` (the check result at start-up),
    ``.run_python(code, *args, host="head", timeout=120, check=True, env=None)`` -> CompletedProcess
    (``python -c code args`` inside ``host``, RAY_ADDRESS set), ``.check(timeout=60)`` -> {"alive":
    [ips], "pinned": {ip: [ip the task saw, hostname]}}, ``.logs(host)`` -> the host's /tmp/ray.
    """

    def __init__(self, bed: Testbed, spec, spec_path: Path):
        self.testbed = bed
        self.spec = spec
        self.spec_path = spec_path
        self.head_ip = bed.head.ip
        self.address = "%s:%d" % (self.head_ip, spec.ports["gcs"])
        self.node_ips = bed.ips
        self.formation: dict = {}

    def logs(self, host: str) -> Path:
        return self.testbed.ray_dir(host)

    def run_python(
        self, code: str, *args, host: str = "head", timeout: float = 120, check: bool = True, env: Optional[dict] = None
    ) -> subprocess.CompletedProcess:
        full_env = {"RAY_ADDRESS": self.address}
        full_env.update(env or {})
        return self.testbed.exec(host, "python", "-c", code, *map(str, args), timeout=timeout, check=check, env=full_env)

    def check(self, timeout: float = 60) -> dict:
        want = sorted(self.node_ips.values())
        p = self.run_python(_CHECK_DRIVER, json.dumps(want), timeout, timeout=timeout + 60, check=False)
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        raise AssertionError(
            f"ray check driver failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}\nlogs: {self.logs('head')}"
        )

    def healthy(self, result: dict) -> bool:
        want = sorted(self.node_ips.values())
        return result.get("alive") == want and all(result["pinned"].get(ip, [None])[0] == ip for ip in want)


def _start_ray(bed: Testbed, ray_env: Optional[Dict[str, str]] = None) -> RayCluster:
    """The one bring-up (kit_testbed.ray_layer.start_ray: firewall, ray start everywhere, wait_nodes),
    then the formation check (a task pinned to every node). `ray_env`: Ray settings for its daemons."""
    from alpa_job.cluster.spec import load_spec

    info = testbed_ray.start_ray(
        bed, num_cpus=RAY_NUM_CPUS, object_store_memory=RAY_OBJECT_STORE, include_dashboard=True, timeout=RAY_START_TIMEOUT, ray_env=ray_env
    )
    spec_path = Path(info["spec_path"])
    cluster = RayCluster(bed, load_spec(str(spec_path)), spec_path)
    result = cluster.check(timeout=RAY_FORM_TIMEOUT)
    if not cluster.healthy(result):
        raise AssertionError(f"Ray cluster did not form on the test bed: {result}; logs under {bed.state_dir}/hosts")
    cluster.formation = result
    return cluster


@pytest.fixture(scope="session")
def ray_cluster(testbed_factory) -> RayCluster:
    pytest.importorskip("ray")
    # cgroups: a process sees its own cgroup's CPU quota (the straggler watch reads how long it throttled).
    bed = testbed_factory(3, tag="ray", held=True, cgroups=True)
    try:
        cluster = _start_ray(bed)
    except BaseException:
        bed.down()  # a half-started cluster must not leak into the rest of the session
        raise
    yield cluster
    # No `ray stop` (scripts/testbed down does one): killing each host's PID 1 takes every Ray process
    # with it, at once.
    bed.down(graceful=False)


# ---- a user's site: controller + dockerd per node + registry + image (kit_testbed.site_layer) ---------
@pytest.fixture(scope="session")
def site_bed(testbed_factory) -> SiteBed:
    from kit_testbed.sshd import SSHD, SshBed

    why = testbed_site.missing_site_requirements()
    if not os.path.exists(SSHD):
        why.append("openssh-server not installed")
    if why:
        pytest.skip("site test bed unavailable: " + "; ".join(why) + " (scripts/setup --test installs them)")
    bed = testbed_factory(3, tag="site", site=True, cgroups=True, held=True)
    ssh = SshBed(bed)
    try:
        # The registry's blobs live in the image cache: the first session pushes every layer, later ones
        # find every layer there and push only the manifest.
        site = testbed_site.start_site(bed, registry_data=testbed_site.IMAGE_CACHE / "registry")
        ssh.start()
    except BaseException:
        ssh.stop()
        bed.down()
        raise
    yield SiteBed(bed, site, ssh)
    ssh.stop()
    bed.down()  # containers removed, dockerds + registry SIGTERMed by PID (site_layer.stop_site), hosts gone
