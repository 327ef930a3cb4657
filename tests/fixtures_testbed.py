"""pytest fixtures for the multi-host test bed (scripts/testbed_lib.py) and a Ray cluster on it.

Fixtures (all session-scoped):

* ``testbed_factory(hosts=3, mgmt=(), shm_size="2g")`` -> ``Testbed``: one test bed per distinct
  shape, created on first request, shared by every test that asks for that shape, torn down at
  session end (also after failures). Skips the test with the reason when not root or ip / unshare /
  nsenter / tini are missing.
* ``testbed``: the shared bed: 3 hosts head/w1/w2 on 10.77.0.0/24, w2 with a management NIC
  (192.168.77.3) holding its default route. Nothing else is loaded in it (no firewall, no Ray):
  tests that start things in it must stop them.
* ``ray_cluster`` -> ``RayCluster``: its OWN 3-host bed (so ``testbed`` stays bare), the spec's
  nftables firewall loaded in each host, Ray head + 2 workers started with
  ``alpa_job.cluster.ray_start.ray_start_args``, formation checked (3 nodes alive at the bed's IPs,
  a task pinned to each node returns that node's IP).

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

import concurrent.futures
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import testbed_lib  # noqa: E402
from testbed_lib import Testbed, TestbedError  # noqa: E402,F401

PREFIX = os.environ.get("AKT_TESTBED_PREFIX", "aktp")
LOCK_TIMEOUT = float(os.environ.get("AKT_TESTBED_LOCK_TIMEOUT", "900"))


class _Beds:
    """The session's test beds, keyed by shape; holds the machine-wide lock while any exists."""

    def __init__(self):
        self.beds: Dict[tuple, Testbed] = {}
        self.lock_fd: Optional[int] = None

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
                    pytest.fail(f"test bed lock /run/lock/{PREFIX}-testbed.lock held by another session "
                                f"for more than {LOCK_TIMEOUT:.0f}s")
                time.sleep(0.5)
        self.lock_fd = fd
        # Leftovers of a killed session (same prefix family): nobody else can own them now.
        for p in testbed_lib.list_prefixes(rf"{PREFIX}\d*"):
            testbed_lib.down(prefix=p)

    def get(self, hosts: int, mgmt=(), shm_size: str = testbed_lib.DEFAULT_SHM, tag: str = "") -> Testbed:
        why = testbed_lib.missing_requirements()
        if why:
            pytest.skip("multi-host test bed unavailable: " + "; ".join(why))
        key = (hosts, tuple(sorted(mgmt)), shm_size, tag)
        bed = self.beds.get(key)
        if bed is not None and not bed.status()["up"]:  # torn down (ray_cluster's) or broken: rebuild
            bed.down()
            self.beds[key] = bed = Testbed.up(hosts, mgmt=mgmt, shm_size=shm_size, prefix=bed.prefix)
        if bed is None:
            self._lock()
            prefix = PREFIX if not self.beds else f"{PREFIX}{len(self.beds)}"
            bed = Testbed.up(hosts, mgmt=mgmt, shm_size=shm_size, prefix=prefix)
            self.beds[key] = bed
        return bed

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


@pytest.fixture(scope="session")
def testbed_factory():
    beds = _Beds()
    try:
        yield beds.get
    finally:
        beds.close()


@pytest.fixture(scope="session")
def testbed(testbed_factory) -> Testbed:
    return testbed_factory(3, mgmt=("w2",))


# ---- Ray on the test bed ---------------------------------------------------------------------------
RAY_NUM_CPUS = 2
RAY_OBJECT_STORE = 200_000_000
RAY_FORM_TIMEOUT = 90

_CHECK_DRIVER = r"""
import json, os, socket, sys, time
import ray
from alpa_job.cluster.wait_nodes import wait_for_nodes
want, timeout = json.loads(sys.argv[1]), float(sys.argv[2])
t0 = time.monotonic()
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
alive = sorted(n["NodeManagerAddress"] for n in wait_for_nodes(len(want), timeout))

@ray.remote(num_cpus=0)
def where():
    return ray.util.get_node_ip_address(), socket.gethostname()

pinned = {}
if sorted(alive) == sorted(want):
    refs = {ip: where.options(resources={"node:" + ip: 0.01}).remote() for ip in want}
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

    def run_python(self, code: str, *args, host: str = "head", timeout: float = 120, check: bool = True,
                   env: Optional[dict] = None) -> subprocess.CompletedProcess:
        full_env = {"RAY_ADDRESS": self.address}
        full_env.update(env or {})
        return self.testbed.exec(host, "python", "-c", code, *map(str, args), timeout=timeout, check=check,
                                 env=full_env)

    def check(self, timeout: float = 60) -> dict:
        want = sorted(self.node_ips.values())
        p = self.run_python(_CHECK_DRIVER, json.dumps(want), timeout, timeout=timeout + 60, check=False)
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError(f"ray check driver failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
                             f"\nlogs: {self.logs('head')}")

    def healthy(self, result: dict) -> bool:
        want = sorted(self.node_ips.values())
        return result.get("alive") == want and all(result["pinned"].get(ip, [None])[0] == ip for ip in want)


def _start_ray(bed: Testbed) -> RayCluster:
    from alpa_job.cluster.firewall import render_nftables
    from alpa_job.cluster.ray_start import ray_start_args
    from alpa_job.cluster.spec import load_spec

    spec_path = bed.state_dir / "cluster-spec.yaml"
    spec_path.write_text(f"cluster_cidr: {bed.subnet}\n")
    spec = load_spec(str(spec_path))
    cluster = RayCluster(bed, spec, spec_path)
    members = list(bed.ips.values())
    for i, h in enumerate(bed.hosts):
        role = "head" if i == 0 else "worker"
        fw = bed.state_dir / f"nftables-{h.name}.nft"
        fw.write_text(render_nftables(spec, h.ip, members, role))
        bed.exec(h.name, "nft", "-f", str(fw), timeout=30)
        for key, value in spec.sysctl().items():
            if key.startswith("net."):  # per network namespace: never touch the machine's own
                bed.exec(h.name, "sysctl", "-q", "-w", f"{key}={value}", timeout=30)

    def argv(i, h):
        return ray_start_args(spec, "head" if i == 0 else "worker", h.ip, head_ip=bed.head.ip,
                              num_cpus=RAY_NUM_CPUS, object_store_memory=RAY_OBJECT_STORE, include_dashboard=True)

    # `ray start` without --block daemonises; the daemons are reparented to the host's tini.
    p = bed.exec("head", *argv(0, bed.head), timeout=RAY_FORM_TIMEOUT, check=False)
    if p.returncode != 0:
        raise AssertionError(f"ray start (head) failed rc={p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with concurrent.futures.ThreadPoolExecutor(len(bed.hosts)) as ex:
        futs = {h.name: ex.submit(bed.exec, h.name, *argv(i, h), timeout=RAY_FORM_TIMEOUT, check=False)
                for i, h in enumerate(bed.hosts) if i > 0}
        for name, fut in futs.items():
            p = fut.result()
            if p.returncode != 0:
                raise AssertionError(f"ray start ({name}) failed rc={p.returncode}:\n{p.stdout[-3000:]}\n"
                                     f"{p.stderr[-3000:]}")
    result = cluster.check(timeout=RAY_FORM_TIMEOUT)
    if not cluster.healthy(result):
        raise AssertionError(f"Ray cluster did not form on the test bed: {result}; logs under {bed.state_dir}/hosts")
    cluster.formation = result
    return cluster


@pytest.fixture(scope="session")
def ray_cluster(testbed_factory) -> RayCluster:
    pytest.importorskip("ray")
    bed = testbed_factory(3, tag="ray")
    try:
        cluster = _start_ray(bed)
    except BaseException:
        bed.down()  # a half-started cluster must not leak into the rest of the session
        raise
    yield cluster
    # No `ray stop`: killing each host's PID 1 takes every Ray process with it, in ~1 s.
    bed.down()
