"""The multi-host test bed itself (scripts/testbed, tests/fixtures_testbed.py): isolation, routing, teardown, Ray."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kit_testbed import hosts as testbed_lib
from fixtures_testbed import PREFIX

pytestmark = pytest.mark.testbed

REPO = Path(__file__).resolve().parent.parent
CLI = REPO / "scripts" / "testbed"

_IDENTITY = r"""
import json, os, socket
print(json.dumps({
    "hostname": socket.gethostname(),
    "resolved": socket.gethostbyname(socket.gethostname()),   # what Gloo binds to
    "pid1": open("/proc/1/comm").read().strip(),
    "shm": sorted(os.listdir("/dev/shm")),
    "shm_fs": [l.split()[2] for l in open("/proc/mounts") if l.split()[1] == "/dev/shm"],
    "ray_dir": sorted(os.listdir("/tmp/ray")),
}))
"""


def test_host_commands_never_inherit_the_callers_ray_auth_mode():
    """An in-process ray.init() leaves RAY_AUTH_MODE=token in the caller's environment; a driver run in an
    auth-off bed with it gets actors that die on start (CI saw exactly that). The bed pins the mode."""
    leftover = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH="/root/.ray/auth_token", RAY_ADDRESS="10.0.0.9:6379")
    env = testbed_lib.python_env(leftover)
    assert env["RAY_AUTH_MODE"] == "disabled"
    assert "RAY_AUTH_TOKEN_PATH" not in env and "RAY_ADDRESS" not in env


def _py(bed, host, code, *args, **kw):
    return bed.exec(host, sys.executable, "-c", code, *args, **kw)


def test_hosts_ping_each_other(testbed):
    if shutil.which("ping") is None:
        pytest.skip("ping not installed (apt-get install iputils-ping)")
    for h in testbed.hosts:
        targets = [t for o in testbed.hosts if o.name != h.name for t in (o.ip, o.name)]
        assert len(targets) == 2 * (len(testbed.hosts) - 1)  # every other host, by IP and by name
        loop = "for t in %s; do ping -c1 -W2 -q $t >/dev/null || { echo unreachable $t; exit 1; }; done" % " ".join(targets)
        p = testbed.exec(h.name, "bash", "-c", loop, timeout=30, check=False)
        assert p.returncode == 0, "%s: %s" % (h.name, p.stdout.strip())


def test_each_host_is_its_own_machine(testbed):
    marker = f"akt-shm-marker-{os.getpid()}"
    testbed.exec("w1", "touch", f"/dev/shm/{marker}", f"/tmp/ray/{marker}")
    try:
        assert not Path("/dev/shm", marker).exists()  # not the machine's /dev/shm
        assert (testbed.ray_dir("w1") / marker).exists()  # /tmp/ray is readable from outside
        for h in testbed.hosts:
            got = json.loads(_py(testbed, h.name, _IDENTITY).stdout)
            assert got["hostname"] == h.name
            assert got["resolved"] == h.ip
            assert got["pid1"] == "tini"
            assert got["shm_fs"][-1] == "tmpfs"  # the top mount: the host's own tmpfs
            assert (marker in got["shm"]) == (h.name == "w1")
            assert (marker in got["ray_dir"]) == (h.name == "w1")
    finally:
        testbed.exec("w1", "rm", "-f", f"/dev/shm/{marker}", f"/tmp/ray/{marker}")


def test_nothing_routes_out(testbed):
    # connect() fails at the route lookup (ENETUNREACH): no packet is ever sent.
    code = r"""
import errno, socket, sys
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("192.0.2.1", 80)); print("connected")
except OSError as e:
    print(errno.errorcode.get(e.errno, e.errno))
"""
    for h in testbed.hosts:
        if h.mgmt_ip is None:
            assert _py(testbed, h.name, code).stdout.strip() == "ENETUNREACH", h.name


def test_binding_another_hosts_ip_fails(testbed):
    code = r"""
import socket, sys
s = socket.socket()
try:
    s.bind((sys.argv[1], 0)); print("ok")
except OSError as e:
    print(e.errno)
"""
    w1, head = testbed.host("w1"), testbed.host("head")
    assert _py(testbed, "w1", code, head.ip).stdout.strip() == str(errno.EADDRNOTAVAIL)  # the seed failure
    assert _py(testbed, "w1", code, w1.ip).stdout.strip() == "ok"


def test_mgmt_nic_holds_default_route(testbed):
    w2 = testbed.host("w2")
    assert w2.mgmt_ip
    route = testbed.exec("w2", "ip", "route", "show", "default").stdout
    assert "dev mgmt0" in route
    # Ray's default guess (a UDP "connect": a route lookup, sends nothing) lands on the mgmt IP ...
    code = 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(("8.8.8.8", 53)); print(s.getsockname()[0])'
    assert _py(testbed, "w2", code).stdout.strip() == w2.mgmt_ip
    # ... while the cluster IP sits on eth0.
    assert f"inet {w2.ip}/" in testbed.exec("w2", "ip", "-4", "addr", "show", "dev", "eth0").stdout


def _live(needle: str):
    """PIDs of live (non-zombie) processes whose command line contains needle."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if needle in cmd and state != "Z":
                out.append(int(d))
    return out


def test_cli_up_exec_down_leaves_nothing(testbed, tmp_path):
    # `testbed` only to hold the session's lock; this test drives its own bed through the CLI.
    prefix = f"{PREFIX}97"  # clear of the fixtures' PREFIX, PREFIX1, PREFIX2, ... beds
    state = tmp_path / "bed"
    base = [sys.executable, str(CLI), "--prefix", prefix, "--state-dir", str(state)]
    run = lambda *a, **kw: subprocess.run(base + list(a), capture_output=True, text=True, timeout=60, **kw)  # noqa: E731
    try:
        up = run("up", "--hosts", "2", "--mgmt", "w1", "--shm-size", "64m")
        assert up.returncode == 0, up.stderr
        info = json.loads(up.stdout)
        assert [h["name"] for h in info["hosts"]] == ["head", "w1"]
        assert info["head_address"] == "10.77.0.1:6379" and info["state_dir"] == str(state)
        again = run("up", "--hosts", "2")
        assert again.returncode == 2 and "already" in again.stderr
        assert run("status").returncode == 0

        p = run("exec", "w1", "--", "sh", "-c", 'pwd; python -c "import alpa_job"; exit 7', cwd=str(REPO))
        assert p.returncode == 7 and p.stdout.strip() == str(REPO), p.stderr
        # daemons (reparented to tini) and a foreground process that `down` must kill
        run("exec", "head", "--", "sh", "-c", "sleep 4242421 >/dev/null 2>&1 & sleep 4242422 >/dev/null 2>&1 &")
        fg = subprocess.Popen(base + ["exec", "w1", "--", "sleep", "4242423"])
        bed = testbed_lib.Testbed.load(state)
        testbed_lib.wait_for(lambda: len(_live("sleep 424242")) == 3, 10, "sleeps")
    finally:
        first = run("down")
    assert first.returncode == 0, first.stderr
    assert fg.wait(timeout=10) != 0
    assert run("down").returncode == 0  # idempotent

    assert not [n for n in testbed_lib.list_netns() if n.startswith(prefix + "-")]
    assert not [n for n in testbed_lib.list_links() if n.startswith(prefix + "-")]
    mounts = Path("/proc/mounts").read_text()
    assert str(state) not in mounts and f"/run/netns/{prefix}-" not in mounts
    assert not _live("sleep 424242") and not _live(f"{prefix}-init-")
    assert not any(testbed_lib.pid_alive(h.pid) for h in bed.hosts)  # each host's tini (PID 1)
    assert not state.exists()
    assert run("status").returncode == 1

    # leftovers of a crashed `up` (no state at all) are found by name and removed
    subprocess.run(["ip", "link", "add", f"{prefix}-br0", "type", "bridge"], check=True)
    subprocess.run(["ip", "netns", "add", f"{prefix}-w3"], check=True)
    assert run("down").returncode == 0
    assert f"{prefix}-" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not [n for n in testbed_lib.list_netns() if n.startswith(prefix + "-")]


@pytest.mark.slow
def test_ray_cluster_forms_on_testbed_ips(ray_cluster):
    # The fixture's formation check: 3 nodes alive at the test-bed IPs, then a task pinned to each
    # node (resources={"node:<ip>": ...}) reports that node's IP and hostname.
    bed = ray_cluster.testbed
    result = ray_cluster.formation
    assert result["alive"] == sorted(h.ip for h in bed.hosts)
    for h in bed.hosts:
        assert result["pinned"][h.ip] == [h.ip, h.name]
    assert ray_cluster.address == f"{bed.head.ip}:6379"
    # the spec's firewall is in force on every host; each host has its own /tmp/ray (logs readable outside)
    for h in bed.hosts:
        assert "alpa_kit" in bed.exec(h.name, "nft", "list", "tables").stdout
        assert (ray_cluster.logs(h.name) / "session_latest").is_symlink()


_AUTH_CLIENT = r"""
import sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
    print("nodes", len([n for n in ray.nodes() if n["Alive"]]))
except Exception as e:
    print("refused", type(e).__name__, str(e)[:200])
"""


@pytest.mark.slow
def test_cli_up_ray_with_auth_and_doctor_then_down_stops_ray(testbed, tmp_path):
    """`scripts/testbed up --ray --auth --doctor`: the one bring-up (scripts/kit_testbed/ray_layer.py) prints the
    address and the token, every node joined, doctor green; a client with the bed's token (exec passes
    it) connects, one with another token is refused; `down` stops Ray with `ray stop` in every host."""
    pytest.importorskip("ray")
    prefix = f"{PREFIX}98"  # clear of the fixtures' PREFIX, PREFIX1, PREFIX2, ... beds
    state = tmp_path / "bed"
    base = [sys.executable, str(CLI), "--prefix", prefix, "--state-dir", str(state)]

    def run(*a, timeout=300):
        return subprocess.run(base + list(a), capture_output=True, text=True, timeout=timeout, cwd=str(REPO))

    pids = set()
    try:
        up = run("up", "--hosts", "2", "--ray", "--auth", "--no-dashboard", "--doctor")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        info = json.loads(up.stdout)
        ray = info["ray"]
        assert ray["address"] == "10.77.0.1:6379" and ray["nodes"] == ["10.77.0.1", "10.77.0.2"]
        assert ray["auth"] is True and len(ray["token"]) == 64 and int(ray["token"], 16) >= 0
        assert (state / "ray" / "auth_token").stat().st_mode & 0o077 == 0  # the token file is private
        assert info["doctor"] == {"ok": True, "rc": 0, "failed": []}
        assert "alpa_kit" in run("exec", "w1", "--", "nft", "list", "tables").stdout  # the spec's firewall

        ok = run("exec", "w1", "--", "python", "-c", _AUTH_CLIENT, ray["address"], timeout=120)
        assert "nodes 2" in ok.stdout, ok.stdout + ok.stderr[-2000:]
        wrong = run("exec", "w1", "--", "env", "RAY_AUTH_TOKEN=" + "0" * 64, "python", "-c", _AUTH_CLIENT, ray["address"], timeout=120)
        assert "refused" in wrong.stdout and "nodes" not in wrong.stdout, wrong.stdout + wrong.stderr[-2000:]

        for ns in (f"{prefix}-head", f"{prefix}-w1"):
            p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
            pids |= {int(x) for x in p.stdout.split()}
        raylets = [p for p in pids if b"raylet" in testbed_lib.cmdline_of(p)]
        assert len(raylets) == 2
    finally:
        down = run("down", timeout=120)
    assert down.returncode == 0, down.stderr
    removed = json.loads(down.stdout)["removed"]
    stopped = [r for r in removed if r.startswith("ray ")]
    assert len(stopped) == 2 and all("Stopped" in r for r in stopped), stopped
    assert not any(testbed_lib.pid_alive(p) for p in pids)
    assert not state.exists()
