"""Ray on the test bed: the ONE bring-up used by ``scripts/testbed up --ray``, the pytest fixtures
(tests/fixtures_testbed.py: ``ray_cluster``) and ``bench/testbed_bringup.py``.

``start_ray(bed)`` does what a site does, with the kit's own pieces:

1. writes the bed's cluster spec (``<state>/cluster-spec.yaml``: ``cluster_cidr`` = the bed's subnet)
   and loads it with ``alpa_job.cluster.spec.load_spec``;
2. loads the spec's nftables ruleset (``alpa_job.cluster.firewall.render_nftables``) and its ``net.*``
   sysctls in every host (one ``sh`` per host, all hosts at once);
3. ``ray start`` with ``alpa_job.cluster.ray_start.ray_start_args`` (every port pinned): the head, and
   every worker as soon as the head's GCS port listens (read from the head's own
   ``/proc/<pid>/net/tcp``: no extra process), at most cores+1 workers at a time. Ray's ``ray start`` gives up
   after a hard-coded 30 s of waiting for its raylet to register (a loaded 2-core machine gets
   there) but leaves the raylet running: such a worker gets ``LATE_JOIN_S`` more to join, and only
   if it is still missing then is it stopped and started once more;
4. waits with ``python -m alpa_job.cluster.wait_nodes`` inside the head (started as soon as the head's
   ``ray start`` returns, so its Python start-up overlaps the workers') until every node is alive.

With ``auth=True`` a token is generated once (``<state>/ray/auth_token``, 0600) and every host runs with
``RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<that file>`` (Ray >= 2.59); ``Testbed.exec`` then passes
the same two variables to every command, so ``doctor``/drivers authenticate without further setup.
Without it ``RAY_AUTH_MODE=disabled`` is pinned (see ``hosts.python_env``).

What was started is recorded in the bed's state (``bed.ray``), so ``scripts/testbed status`` shows
it and ``down`` stops Ray cleanly (``stop_ray``: ``ray stop`` in every host at once, bounded) before
it kills the hosts.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from kit_testbed import hosts as tb

DEFAULT_NUM_CPUS = 1
DEFAULT_OBJECT_STORE = 100_000_000
# An upper bound only (a quiet machine needs a fraction of it); it covers Ray's own 30 s registration limit,
# LATE_JOIN_S and one restart on a machine that other work keeps busy.
DEFAULT_TIMEOUT = 240.0
LATE_JOIN_S = 45.0  # how long a worker whose `ray start` timed out may still join before it is restarted
TOKEN_FILE = "auth_token"


def spec_for(bed: "tb.Testbed"):
    """The bed's cluster spec (written once to ``<state>/cluster-spec.yaml``) and its path."""
    from alpa_job.cluster.spec import load_spec

    path = bed.state_dir / "cluster-spec.yaml"
    if not path.exists():
        path.write_text(f"cluster_cidr: {bed.subnet}\n")
    return load_spec(str(path)), path


def load_firewall(bed: "tb.Testbed", spec, timeout: float = 30) -> None:
    """The spec's nftables ruleset (members = every host) and ``net.*`` sysctls in every host, at once."""
    from alpa_job.cluster.firewall import render_nftables

    members = list(bed.ips.values())
    scripts = {}
    for i, h in enumerate(bed.hosts):
        fw = bed.state_dir / f"nftables-{h.name}.nft"
        fw.write_text(render_nftables(spec, h.ip, members, "head" if i == 0 else "worker"))
        lines = ["set -e", f"nft -f {shlex.quote(str(fw))}"]
        # net.* only: they are per network namespace, so the machine's own stay untouched.
        lines += [f"sysctl -q -w {shlex.quote(f'{k}={v}')}" for k, v in spec.sysctl().items() if k.startswith("net.")]
        scripts[h.name] = "\n".join(lines)
    _parallel({name: (lambda n=name: bed.exec(n, "sh", "-c", scripts[n], timeout=timeout, check=False)) for name in scripts}, "firewall")


def _parallel(jobs: Dict[str, "callable"], what: str) -> Dict[str, subprocess.CompletedProcess]:
    with concurrent.futures.ThreadPoolExecutor(max(1, len(jobs))) as ex:
        futs = {name: ex.submit(fn) for name, fn in jobs.items()}
        out = {name: f.result() for name, f in futs.items()}
    bad = {n: p for n, p in out.items() if p.returncode != 0}
    if bad:
        n, p = next(iter(bad.items()))
        raise tb.TestbedError(f"{what} failed on {', '.join(bad)} (rc={p.returncode}): {_tail(p)}")
    return out


def _tail(p: subprocess.CompletedProcess, n: int = 1500) -> str:
    return ((p.stderr or "")[-n:] + (p.stdout or "")[-n // 3 :]).strip()


def _kill(proc: subprocess.Popen):
    """SIGKILL a command started with ``bed.popen`` AND what runs inside the host (nsenter's child: it
    would otherwise live on under the host's tini); returns ``communicate()``'s output."""
    for child in tb.children_of(proc.pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    return proc.communicate()


def auth_env(token_path: Optional[str]) -> Dict[str, str]:
    """The variables every process of an auth-on bed needs (Ray's token auth, token read from a file)."""
    if not token_path:
        return {"RAY_AUTH_MODE": "disabled"}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}


def _where_ray_listens(bed: "tb.Testbed", spec, include_dashboard: bool) -> dict:
    """The bed's Ray address (the head's GCS) and dashboard URL (None when it has none)."""
    dashboard = "http://%s:%d" % (bed.head.ip, spec.ports["dashboard"]) if include_dashboard else None
    return {"address": "%s:%d" % (bed.head.ip, spec.ports["gcs"]), "dashboard": dashboard}


# The bring-up in the order it happens (firewall, record, head, workers, wait), each step a helper;
# long: the rest is its signature and the record's fields, one a line as the formatter writes them.
def start_ray(
    bed: "tb.Testbed",
    num_cpus: int = DEFAULT_NUM_CPUS,
    object_store_memory: int = DEFAULT_OBJECT_STORE,
    include_dashboard: bool = True,
    firewall: bool = True,
    auth: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    max_parallel: Optional[int] = None,
    ray_env: Optional[Dict[str, str]] = None,
) -> dict:
    """Firewall + Ray on every host of ``bed`` + wait until all nodes are alive. Returns ``bed.ray``:
    {"address", "dashboard", "spec_path", "nodes", "auth", "token_path", "seconds": {step: s}, ...}.

    Raises TestbedError naming the host and the log to read; the bed is left up (for its logs).
    """
    if bed.ray:
        raise tb.TestbedError(f"Ray is already started on test bed {bed.prefix!r} ({bed.ray['address']}); `scripts/testbed down` first")
    t0 = time.monotonic()
    seconds: Dict[str, float] = {}
    spec, spec_path = spec_for(bed)
    if firewall:
        load_firewall(bed, spec)
    seconds["firewall"] = time.monotonic() - t0

    token_path = _new_token(bed) if auth else None
    info = dict(
        _where_ray_listens(bed, spec, include_dashboard),
        spec_path=str(spec_path),
        auth=bool(auth),
        token_path=token_path,
        num_cpus=num_cpus,
        object_store_memory=object_store_memory,
        firewall=bool(firewall),
        nodes=[],
        seconds=seconds,
    )
    bed.ray = info  # recorded before starting anything: `down` stops what got started
    bed.save()

    # ray_env: Ray's own settings for every `ray start` (RAY_<system config name>), e.g. its health checks.
    run = _RayStart(
        bed,
        spec,
        {**auth_env(token_path), **(ray_env or {})},
        timeout,
        num_cpus=num_cpus,
        object_store_memory=object_store_memory,
        include_dashboard=include_dashboard,
    )
    mark = time.monotonic()
    head_proc = run.start_head()
    seconds["head_gcs"] = time.monotonic() - mark
    waiter, rcs = run.start_workers(head_proc, max_parallel or max(2, (os.cpu_count() or 2) + 1), seconds, mark)
    late = [name for name, rc in rcs.items() if rc != 0]
    seconds["ray_start"] = time.monotonic() - mark
    info["late_workers"], info["worker_retries"] = late, []
    mark = time.monotonic()
    if late:
        waiter = run.wait_for_late(waiter, late, info)

    info["nodes"] = finish_wait_nodes(bed, waiter, len(bed.hosts))
    seconds["wait"] = time.monotonic() - mark  # what was left of the wait after every `ray start` returned
    seconds["total"] = time.monotonic() - t0
    info["seconds"] = {k: round(v, 2) for k, v in seconds.items()}
    bed.save()
    return info


def rejoin(
    bed: "tb.Testbed", names: Sequence[str], ray_env: Optional[Dict[str, str]] = None, timeout: float = DEFAULT_TIMEOUT
) -> List[str]:
    """``ray start`` again on the workers ``names`` of a bed whose Ray is up (hosts started anew after a test
    killed them: ``Testbed.revive``), with the options ``start_ray`` recorded; then until every node is alive.
    ``ray_env``: as given to ``start_ray``. Returns the alive node IPs."""
    info = bed.ray
    if not info:
        raise tb.TestbedError(f"no Ray on test bed {bed.prefix!r} to rejoin")
    if bed.head.name in names:
        raise tb.TestbedError("the head's Ray cannot rejoin: start Ray again on every host (start_ray)")
    spec, _ = spec_for(bed)
    run = _RayStart(
        bed,
        spec,
        {**auth_env(info.get("token_path")), **(ray_env or {})},
        timeout,
        num_cpus=info["num_cpus"],
        object_store_memory=info["object_store_memory"],
        include_dashboard=bool(info.get("dashboard")),
    )
    started = {name: run.launch(bed.hosts.index(bed.host(name)), bed.host(name)) for name in names}
    for name, proc in started.items():
        run.finish(name, proc)  # a late `ray start` (its 30 s limit) leaves its raylet joining: waited for below
    info["nodes"] = wait_nodes(bed, len(bed.hosts), run.left(5.0))
    bed.save()
    return info["nodes"]


def _new_token(bed: "tb.Testbed") -> str:
    """A fresh auth token in ``<state>/ray/auth_token`` (0600); returns its path."""
    tdir = bed.state_dir / "ray"
    tdir.mkdir(mode=0o700, exist_ok=True)
    token_file = tdir / TOKEN_FILE
    token_file.write_text(secrets.token_hex(32))  # Ray's own generator: 256 bits as hex
    token_file.chmod(0o600)
    return str(token_file)


class _RayStart:
    """The `ray start` part of one ``start_ray``: one deadline for all of it, a log per host."""

    def __init__(self, bed: "tb.Testbed", spec, env: Dict[str, str], timeout: float, **start_options):
        from alpa_job.cluster.ray_start import ray_start_args
        from alpa_job.versions import package_version

        self.bed, self.spec, self.env, self.timeout = bed, spec, env, timeout
        # The hosts run the caller's Python environment (hosts.python_env), so its Ray: the
        # project venv's modern Ray, or 2.1.0 from a Python 3.9 one (the Alpa image's Ray), each with the
        # flags it knows (None: no Ray installed; ray_start_args then assumes the spec's modern Ray).
        ray_version = package_version("ray")
        self.argv = lambda i, h: ray_start_args(
            spec, "head" if i == 0 else "worker", h.ip, head_ip=bed.head.ip, ray_version=ray_version, **start_options
        )
        self.logs = bed.state_dir / "ray-start"
        self.logs.mkdir(exist_ok=True)
        self.deadline = time.monotonic() + timeout

    def left(self, at_least: float) -> float:
        return max(at_least, self.deadline - time.monotonic())

    def launch(self, i: int, h) -> subprocess.Popen:
        out = open(self.logs / f"{h.name}.log", "w")
        try:
            return self.bed.popen(h.name, *self.argv(i, h), env=self.env, stdout=out, stderr=subprocess.STDOUT, text=True)
        finally:
            out.close()

    def finish(self, name: str, proc: subprocess.Popen) -> int:
        try:
            return proc.wait(timeout=self.left(1.0))
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise tb.TestbedError(
                f"`ray start` on {name} did not return within {self.timeout:.0f}s; "
                f"read {self.logs / (name + '.log')} and {self.bed.ray_dir(name)}/session_*/logs"
            ) from None

    def failed(self, name: str) -> str:
        text = (self.logs / f"{name}.log").read_text(errors="replace").strip().splitlines()
        return (text[-1] if text else "")[:300]

    def start_head(self) -> subprocess.Popen:
        """``ray start --head``, returned as soon as its GCS port listens (or it exited)."""
        head_proc = self.launch(0, self.bed.head)
        gcs_port = self.spec.ports["gcs"]
        # Workers need only the GCS (they retry its KV reads); the head's `ray start` goes on to start
        # its raylet, dashboard and monitor meanwhile.
        tb.wait_for(
            lambda: tb.listening(self.bed.head.pid, gcs_port) or head_proc.poll() is not None,
            self.left(1.0),
            f"the head's GCS port {gcs_port}",
        )
        return head_proc

    def start_workers(self, head_proc: subprocess.Popen, parallel: int, seconds: Dict[str, float], mark: float):
        """``ray start`` on every worker, at most ``parallel`` at once, and ``wait_nodes`` in the head once
        the head's ``ray start`` returned; returns (that waiter, {worker: rc of its `ray start`})."""
        # At most `parallel` at once: each start is CPU-bound (a Python CLI, an agent or two, a log
        # monitor), so more at once on a few cores only stretches every one of them towards Ray's fixed
        # 30 s registration limit; the total is the same.
        pending = [(i, h) for i, h in enumerate(self.bed.hosts) if i > 0]
        running: Dict[str, subprocess.Popen] = {}
        rcs: Dict[str, int] = {}
        waiter = None
        while pending or running or waiter is None:
            while pending and len(running) < parallel:
                i, h = pending.pop(0)
                running[h.name] = self.launch(i, h)
            if waiter is None and head_proc.poll() is not None:
                seconds["head_start"] = time.monotonic() - mark
                waiter = self._wait_after_head(head_proc)
            for name, proc in list(running.items()):
                if proc.poll() is not None:
                    rcs[name] = proc.returncode
                    del running[name]
            if time.monotonic() > self.deadline:
                for proc in list(running.values()) + [head_proc]:
                    _kill(proc)
                raise tb.TestbedError(
                    f"`ray start` did not return within {self.timeout:.0f}s on "
                    f"{', '.join(sorted(running)) or 'head'}; read {self.logs}/<host>.log and "
                    f"{self.bed.state_dir}/hosts/<host>/ray/session_*/logs"
                )
            time.sleep(0.05)
        return waiter, rcs

    def _wait_after_head(self, head_proc: subprocess.Popen) -> subprocess.Popen:
        if head_proc.returncode != 0:
            raise tb.TestbedError(
                f"`ray start --head` failed on head (rc={head_proc.returncode}): {self.failed('head')}; read {self.logs / 'head.log'}"
            )
        # The wait (a Python start-up + ray.init) overlaps the workers' start-up: the head's raylet is
        # up now, which is all a driver on the head needs.
        return start_wait_nodes(self.bed, len(self.bed.hosts), self.left(5.0))

    def wait_for_late(self, waiter: subprocess.Popen, late: List[str], info: dict) -> subprocess.Popen:
        """Ray's `ray start` gives up after a hard-coded 30 s of waiting for its raylet to register, but
        leaves that raylet running; on a loaded machine it registers a little later. So: give the late
        ones LATE_JOIN_S, and restart (once) only the nodes still missing after that. Returns the waiter
        to finish (``info["worker_retries"]``: the restarted ones)."""
        try:
            waiter.wait(timeout=min(LATE_JOIN_S, self.left(1.0)))
            return waiter
        except subprocess.TimeoutExpired:
            _kill(waiter)
        bed = self.bed
        alive = set(alive_now(bed))
        retry = [name for name in late if bed.host(name).ip not in alive]
        info["worker_retries"] = retry
        _parallel(
            {r: (lambda r=r: bed.exec(r, "ray", "stop", "--force", timeout=60, check=False, env=self.env)) for r in retry},
            "ray stop before the retry",
        )
        again = {r: self.launch(bed.hosts.index(bed.host(r)), bed.host(r)) for r in retry}
        for name, proc in again.items():
            if self.finish(name, proc) != 0:
                raise tb.TestbedError(
                    f"`ray start` failed twice on {name}: {self.failed(name)}; read "
                    f"{self.logs / (name + '.log')} and {bed.ray_dir(name)}/session_*/logs"
                )
        return start_wait_nodes(bed, len(bed.hosts), self.left(5.0))


def start_wait_nodes(bed: "tb.Testbed", count: int, timeout: float) -> subprocess.Popen:
    """``python -m alpa_job.cluster.wait_nodes`` inside the head, in the background."""
    proc = bed.popen(
        "head",
        "python",
        "-m",
        "alpa_job.cluster.wait_nodes",
        "--count",
        str(count),
        "--timeout",
        "%.0f" % timeout,
        "--address",
        bed.ray["address"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.timeout = timeout + 60
    return proc


def finish_wait_nodes(bed: "tb.Testbed", proc: subprocess.Popen, count: int) -> List[str]:
    """The alive node IPs once ``start_wait_nodes`` is done, or TestbedError naming the missing nodes."""
    try:
        out, err = proc.communicate(timeout=proc.timeout)
    except subprocess.TimeoutExpired:
        out, err = _kill(proc)
    alive = []
    for line in out.splitlines():
        if line.startswith("{"):
            alive = json.loads(line).get("alive", [])
    if proc.returncode != 0 or len(alive) < count:
        missing = sorted(set(bed.ips.values()) - set(alive))
        raise tb.TestbedError(
            f"only {len(alive)} of {count} Ray nodes alive (missing {missing}): "
            f"{(err or '').strip().splitlines()[-1:] or proc.returncode}; read "
            f"{bed.state_dir}/hosts/<host>/ray/session_latest/logs/raylet.out"
        )
    return sorted(alive)


def alive_now(bed: "tb.Testbed") -> List[str]:
    """The IPs of the Ray nodes alive right now (``wait_nodes --count 0``: it answers at once)."""
    proc = start_wait_nodes(bed, 0, 1)
    out, _ = proc.communicate(timeout=proc.timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]).get("alive", []) if lines else []


def wait_nodes(bed: "tb.Testbed", count: int, timeout: float) -> List[str]:
    """``python -m alpa_job.cluster.wait_nodes`` inside the head: the alive node IPs, or TestbedError."""
    return finish_wait_nodes(bed, start_wait_nodes(bed, count, timeout), count)


def stop_ray(bed: "tb.Testbed", timeout: float = 30) -> Dict[str, str]:
    """``ray stop`` in every host at once (each host has its own PID namespace: it stops only its own
    processes). Returns {host: Ray's last output line}; never raises (``down`` kills what is left)."""
    env = auth_env((bed.ray or {}).get("token_path"))
    alive = [h for h in bed.hosts if tb.pid_alive(h.pid)]

    def stop(name):
        try:
            p = bed.exec(name, "ray", "stop", "--grace-period", "10", timeout=timeout, check=False, env=env)
            lines = re.sub(r"\x1b\[[0-9;]*m", "", p.stdout + p.stderr).strip().splitlines()
            return lines[-1].split(" -- ", 1)[-1] if lines else f"rc={p.returncode}"
        except (subprocess.TimeoutExpired, tb.TestbedError, OSError) as e:
            return f"not stopped: {e}"

    with concurrent.futures.ThreadPoolExecutor(max(1, len(alive))) as ex:
        futs = {h.name: ex.submit(stop, h.name) for h in alive}
        out = {name: f.result() for name, f in futs.items()}
    bed.ray = None
    try:
        bed.save()
    except OSError:
        pass
    return out


def token_of(bed: "tb.Testbed") -> Optional[str]:
    path = (bed.ray or {}).get("token_path")
    return Path(path).read_text().strip() if path and os.path.exists(path) else None


def doctor(
    bed: "tb.Testbed", deadline: float = 60, timeout: float = 120, node_timeout: Optional[float] = None, extra: Sequence[str] = ()
) -> dict:
    """``python -m alpa_job doctor --format json`` inside the head against the bed's Ray; the parsed
    report ({"ok": bool, "checks": [...]}) plus "rc"; {"ok": False, "error": ...} when it printed no JSON.
    ``node_timeout``: doctor's per-node probe limit (its default, 10 s, is short for a first task on a
    loaded 2-core machine: a Python worker must start on every node)."""
    if not bed.ray:
        raise tb.TestbedError(f"no Ray on test bed {bed.prefix!r}: `scripts/testbed up --hosts N --ray` first")
    p = bed.exec(
        "head",
        "python",
        "-m",
        "alpa_job",
        "doctor",
        "--address",
        bed.ray["address"],
        "--cluster-spec",
        bed.ray["spec_path"],
        "--format",
        "json",
        "--deadline",
        "%.0f" % deadline,
        *(["--node-timeout", "%.0f" % node_timeout] if node_timeout else []),
        *extra,
        timeout=timeout,
        check=False,
    )
    try:
        report = json.loads(p.stdout)
    except ValueError:
        report = {"ok": False, "error": _tail(p, 600)}
    report["rc"] = p.returncode
    return report


# ---- the layer: how the core and `scripts/testbed up --ray` reach this module -------------------------
def add_arguments(up) -> None:
    ray = up.add_argument_group("Ray (scripts/kit_testbed/ray_layer.py)")
    ray.add_argument("--ray", action="store_true", help="firewall + Ray on every host, wait until all are alive")
    ray.add_argument("--auth", action="store_true", help="Ray token auth on (token generated, printed)")
    ray.add_argument("--doctor", action="store_true", help="then run `alpa_job doctor` in the head; exit 3 if red")
    ray.add_argument("--num-cpus", type=int, default=DEFAULT_NUM_CPUS, help="per node")
    ray.add_argument(
        "--object-store-memory",
        type=int,
        default=DEFAULT_OBJECT_STORE,
        help="bytes per node (each node would otherwise claim the machine's whole RAM)",
    )
    ray.add_argument("--no-dashboard", action="store_true", help="head without dashboard (no `ray job submit`)")
    ray.add_argument("--no-firewall", action="store_true", help="do not load the spec's nftables rules")
    ray.add_argument("--ray-timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds for ray start + join")


def check_arguments(args, usage_error) -> None:
    for flag in ("auth", "doctor", "no_dashboard", "no_firewall"):
        if getattr(args, flag) and not args.ray:
            usage_error(f"--{flag.replace('_', '-')} needs --ray")


def start_from_arguments(bed: "tb.Testbed", args) -> None:
    if args.ray and not bed.ray:  # (a reused bed keeps the Ray it has)
        start_ray(
            bed,
            num_cpus=args.num_cpus,
            object_store_memory=args.object_store_memory,
            include_dashboard=not args.no_dashboard,
            firewall=not args.no_firewall,
            auth=args.auth,
            timeout=args.ray_timeout,
        )


def report_doctor(bed: "tb.Testbed", args, out: dict) -> int:
    """With ``--doctor``: doctor's verdict under ``out["doctor"]``; exit 3 when it is not green."""
    if not args.doctor:
        return 0
    report = doctor(bed)
    out["doctor"] = {
        "ok": bool(report.get("ok")),
        "rc": report["rc"],
        "failed": [c for c in report.get("checks", []) if not c.get("ok")][:5],
    }
    if report.get("error"):
        out["doctor"]["error"] = report["error"]
    return 0 if report.get("ok") else 3


def summary(bed: "tb.Testbed") -> Optional[dict]:
    if not bed.ray:
        return None
    out = {k: bed.ray.get(k) for k in ("address", "dashboard", "spec_path", "nodes", "auth", "token_path", "seconds")}
    token = token_of(bed)
    if token is not None:
        out["token"] = token
    return out


def exec_env(bed: "tb.Testbed") -> Dict[str, str]:
    """Ray token auth on: every client in the bed needs the token (auth off is pinned by python_env)."""
    token_path = (bed.ray or {}).get("token_path")
    return auth_env(token_path) if token_path else {}


def stop_layer(bed: Optional["tb.Testbed"], prefix: str, graceful: bool) -> List[str]:
    if not (bed and bed.ray and graceful):
        return []
    return [f"ray {name}: {line}" for name, line in stop_ray(bed).items()]


# After the site's daemons (they need no Ray), so Ray stops first on the way down.
LAYER = tb.register_layer(
    tb.Layer(
        name="ray",
        order=20,
        add_arguments=add_arguments,
        check_arguments=check_arguments,
        start=start_from_arguments,
        report=report_doctor,
        summary=summary,
        exec_env=exec_env,
        stop=stop_layer,
    )
)
