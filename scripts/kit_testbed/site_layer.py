"""A user's site on the test bed: a Docker engine in every node host, an image registry on
the controller, the modern CPU image pushed there. Hosts, controller and router: kit_testbed.hosts
(``Testbed.up(..., site=True, cgroups=True)``); this module starts and stops the daemons on top.

``start_site(bed, docker=True, registry=True, image=True)``:

* **dockerd in every node host** (Debian's ``docker.io``), started through ``bed.popen`` so it runs in
  the host's namespaces, with ``--iptables=false --ip-forward=false --ip-masq=false --bridge=none``
  (containers use ``network_mode: host``; the machine's and the hosts' netfilter stay untouched),
  its own ``--data-root <state>/docker/<host>``, ``--exec-root /run/<prefix>-docker/<host>``, socket
  ``unix:///run/<prefix>-docker/<host>.sock`` and ``--insecure-registry <registry>`` (plain HTTP on the
  admin network). Its PID as seen from outside (nsenter's child) is recorded; stopped with SIGTERM
  by that PID. ``/run`` is shared by all hosts, so each socket is reachable from anywhere on this
  machine, while the daemon behind it lives in its host (a test-bed convenience; a site uses SSH);
* **a registry on the controller**: Debian's ``docker-registry`` (distribution 2.8), listening on
  ``<controller IP>:5000``, storage ``<state>/registry``; recorded and stopped by PID;
* **the image**: the modern CPU image (``images.jax_cpu`` of the cluster spec, built by
  ``scripts/build-images --cpu`` with buildah from a debootstrap base; the storage CI's
  tests/test_image_build.py uses, ``$ALPA_KIT_IMAGE_CACHE``) pushed from inside the controller with
  ``buildah push --tls-verify=false`` to ``<registry>/<images.jax_cpu>``. Built first if missing
  (minutes; needs PyPI and the Debian mirror).

Everything is recorded in ``bed.site`` (state.json), so ``scripts/testbed down`` stops it
(``stop_site``: containers removed, dockerds and the registry SIGTERMed by PID, exec-roots removed)
before it kills the hosts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from kit_testbed import hosts as tb

DOCKERD = "/usr/sbin/dockerd"
REGISTRY = "/usr/bin/docker-registry"
REGISTRY_PORT = 5000
# Debian's client matches the 20.10 daemon; a newer static /usr/local/bin/docker also works (API downgrade).
DOCKER_CLI = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else (shutil.which("docker") or "docker")
IMAGE_CACHE = Path(os.environ.get("ALPA_KIT_IMAGE_CACHE", "/var/tmp/alpa-cluster-kit-images"))
BASE_IMAGE = "localhost/debian:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"


class SiteError(tb.TestbedError):
    """A site daemon could not start (message names the log and the fix)."""


def missing_site_requirements(docker: bool = True, registry: bool = True, image: bool = True) -> List[str]:
    why = []
    if docker and not os.path.exists(DOCKERD):
        why.append(f"{DOCKERD} not found: apt-get install docker.io (scripts/setup --test does)")
    if registry and not os.path.exists(REGISTRY):
        why.append(f"{REGISTRY} not found: apt-get install docker-registry (scripts/setup --test does)")
    if image and shutil.which("buildah") is None:
        why.append("buildah not found: apt-get install buildah (scripts/setup --test does)")
    return why


def docker_socket(bed: "tb.Testbed", host: str) -> str:
    return f"unix:///run/{bed.prefix}-docker/{host}.sock"


def docker(bed: "tb.Testbed", host: str, *args, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """The docker CLI against ``host``'s dockerd, run inside ``host`` (so pulls go over its network)."""
    return bed.exec(host, DOCKER_CLI, "-H", docker_socket(bed, host), *args, timeout=timeout, check=check)


# ---- image storage (the one CI's image build writes) -----------------------------------------------
def image_env() -> Dict[str, str]:
    """containers/storage + containers.conf of the image cache (as in tests/test_image_build.py)."""
    IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
    storage = IMAGE_CACHE / "storage.conf"
    if not storage.exists():
        storage.write_text('[storage]\ndriver = "overlay"\ngraphroot = "%s/storage"\nrunroot = "%s/run"\n' % (IMAGE_CACHE, IMAGE_CACHE))
    conf = IMAGE_CACHE / "containers.conf"
    if not conf.exists():
        conf.write_text('[containers]\nnetns = "host"\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n')
    env = {"CONTAINERS_STORAGE_CONF": str(storage), "CONTAINERS_CONF": str(conf)}
    if os.path.exists("/etc/ssl/certs/ca-certificates.crt"):
        env["PIP_CERT"] = os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
    return env


@contextlib.contextmanager
def image_cache_lock(what: str = "build"):
    """One maker of `what` in the image cache at a time, across processes. The default, its shared images: the
    site bed's CPU image (ensure_cpu_image) and tests/test_image_build.py, which runs beside the test beds in
    the suite, build the same base and the same tag into this storage."""
    IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
    with open(IMAGE_CACHE / f"{what}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def cpu_image_tag() -> str:
    from alpa_job.cluster.spec import load_spec

    return load_spec().images["jax_cpu"]


def _local_ref(tag: str) -> str:
    return tag if tag.split("/", 1)[0] in ("localhost",) or "." in tag.split("/", 1)[0] else "localhost/" + tag


def _have_image(ref: str, env: Dict[str, str]) -> bool:
    p = subprocess.run(
        ["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", ref],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    return p.returncode == 0


def kit_source_hash() -> str:
    """What the CPU image bakes in: the kit's package, the Dockerfiles and locks, the project file."""
    digest = hashlib.sha256()
    root = tb.REPO_ROOT
    files = [
        f
        for pattern in ("alpa_job/**/*.py", "alpa_job/**/*.yaml", "alpa_job/**/*.json", "docker/**/*", "requirements/image-*.txt")
        for f in root.glob(pattern)
        if f.is_file() and "__pycache__" not in f.parts
    ]
    for f in sorted(set(files)) + [root / "pyproject.toml"]:
        digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def ensure_cpu_image(log=print) -> str:
    """The modern CPU image in the image cache's storage, built if missing or if the kit it bakes in has
    changed since (a stale image runs old code: a newer cluster plan's keys are then refused); its ref."""
    with image_cache_lock():
        return _ensure_cpu_image(log)


def _ensure_cpu_image(log) -> str:
    env = image_env()
    tag = cpu_image_tag()
    ref = _local_ref(tag)
    stamp = IMAGE_CACHE / "cpu-image.source-hash"
    wanted = kit_source_hash()
    if _have_image(ref, env) and stamp.exists() and stamp.read_text().strip() == wanted:
        return ref
    full = {**os.environ, **env, "PYTHON": sys.executable}
    if not _have_image(BASE_IMAGE, env):
        tarball = IMAGE_CACHE / "debian-bookworm-minbase.tar"
        if not tarball.exists():
            rootfs = IMAGE_CACHE / "rootfs"
            shutil.rmtree(rootfs, ignore_errors=True)
            log(f"debootstrap bookworm -> {rootfs}")
            _check(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), DEBIAN_MIRROR], 900, full)
            for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for f in (rootfs / sub).glob("*"):
                    if f.is_file():
                        f.unlink()
            _check(["tar", "-C", str(rootfs), "-cf", str(tarball) + ".part", "."], 300, full)
            os.rename(str(tarball) + ".part", tarball)
            shutil.rmtree(rootfs, ignore_errors=True)
        _check(["podman", "import", str(tarball), BASE_IMAGE], 300, full)
    log(f"scripts/build-images --cpu -> {tag} (minutes)")
    _check([str(tb.REPO_ROOT / "scripts" / "build-images"), "--cpu", "--base", BASE_IMAGE, "--tool", "buildah"], 1800, full)
    stamp.write_text(wanted + "\n")
    return ref


def _check(argv, timeout, env):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise SiteError(f"`{' '.join(argv[:3])} ...` failed (rc={p.returncode}): {(p.stderr or p.stdout)[-800:]}")
    return p


# ---- daemons ---------------------------------------------------------------------------------------
def _outer_child(launcher: subprocess.Popen, exe: str, what: str, log: Path, timeout: float = 20) -> int:
    """The PID (as seen from outside) of ``exe`` that ``bed.popen`` started: nsenter's only child."""
    real = os.path.realpath(exe)

    def found():
        if launcher.poll() is not None:
            raise SiteError(f"{what} exited at once (rc={launcher.returncode}): {_last_lines(log)}; read {log}")
        for c in tb.children_of(launcher.pid):
            if os.path.realpath(tb.exe_of(c)) == real:
                return c
        return None

    return tb.wait_for(found, timeout, f"{what} to start")


def _last_lines(path: Path, n: int = 2) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])[-400:]
    except OSError:
        return ""


def start_registry(bed: "tb.Testbed", data: Optional[os.PathLike] = None, timeout: float = 30) -> dict:
    """docker-registry on the controller; blobs in ``data`` (default ``<state>/registry/data``, gone with
    the bed; a persistent dir such as ``$ALPA_KIT_IMAGE_CACHE/registry`` makes the next push ~free)."""
    ctl = bed.controller
    if ctl is None:
        raise SiteError("a registry lives on the controller: bring the bed up with --site")
    root = bed.state_dir / "registry"
    data = Path(data) if data else root / "data"
    data.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    addr = f"{ctl.ip}:{REGISTRY_PORT}"
    conf = root / "config.yml"
    conf.write_text(
        "\n".join(
            [
                "version: 0.1",
                "log: {level: info, fields: {service: registry}}",
                "storage:",
                f"  filesystem: {{rootdirectory: '{data}'}}",
                "  delete: {enabled: true}",
                f"http: {{addr: '{addr}'}}",
                "",
            ]
        )
    )
    log = root / "registry.log"
    with open(log, "ab") as out:
        launcher = bed.popen(ctl.name, REGISTRY, "serve", str(conf), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pid = _outer_child(launcher, REGISTRY, "docker-registry on the controller", log)
    tb.wait_for(lambda: tb.listening(ctl.pid, REGISTRY_PORT) or not tb.pid_alive(pid), timeout, f"the registry to listen on {addr}")
    if not tb.pid_alive(pid):
        raise SiteError(f"docker-registry exited: {_last_lines(log)}; read {log}")
    return {"address": addr, "pid": pid, "data": str(data), "log": str(log), "config": str(conf)}


def _dockerd_argv(config: Path, data_root: Path, exec_root: Path, sock: str, pidfile: Path, insecure_registry: Optional[str]) -> List[str]:
    """A node's dockerd: its own config, data, exec root, socket and pid file; no iptables, no bridge (the
    bed's nftables and veths are the network)."""
    argv = [DOCKERD, "--config-file", str(config), "--iptables=false", "--ip-forward=false", "--ip-masq=false"]
    argv += ["--bridge=none", "--storage-driver", "overlay2", "--exec-opt", "native.cgroupdriver=cgroupfs"]
    argv += ["--data-root", str(data_root), "--exec-root", str(exec_root), "-H", sock, "--pidfile", str(pidfile)]
    return argv + (["--insecure-registry", insecure_registry] if insecure_registry else [])


def start_dockerds(bed: "tb.Testbed", insecure_registry: Optional[str] = None, timeout: float = 60) -> Dict[str, dict]:
    """One dockerd per node host, all at once; waits until each answers ``docker version``."""
    if not bed.cgroups:
        raise SiteError(
            "dockerd needs the cgroup hierarchies inside the hosts: bring the bed up with --docker (Testbed.up(..., cgroups=True))"
        )
    run_dir = Path(f"/run/{bed.prefix}-docker")
    run_dir.mkdir(parents=True, exist_ok=True)
    empty = bed.state_dir / "docker" / "daemon.json"
    empty.parent.mkdir(parents=True, exist_ok=True)
    empty.write_text("{}\n")  # never the machine's /etc/docker/daemon.json
    out: Dict[str, dict] = {}
    launchers = {}
    for h in bed.hosts:
        d = bed.state_dir / "docker" / h.name
        (d / "data").mkdir(parents=True, exist_ok=True)
        sock = docker_socket(bed, h.name)
        argv = _dockerd_argv(empty, d / "data", run_dir / h.name, sock, run_dir / f"{h.name}.pid", insecure_registry)
        log = d / "dockerd.log"
        with open(log, "ab") as f:
            launchers[h.name] = bed.popen(h.name, *argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        out[h.name] = {"socket": sock, "data_root": str(d / "data"), "exec_root": str(run_dir / h.name), "log": str(log)}
    for name, launcher in launchers.items():
        out[name]["pid"] = _outer_child(launcher, DOCKERD, f"dockerd on {name}", Path(out[name]["log"]))
    deadline = time.monotonic() + timeout

    def answers(name):
        while True:
            p = docker(bed, name, "version", "--format", "{{.Server.Version}}", timeout=30, check=False)
            if p.returncode == 0 and p.stdout.strip():
                return p.stdout.strip()
            if not tb.pid_alive(out[name]["pid"]):
                raise SiteError(f"dockerd on {name} exited: {_last_lines(Path(out[name]['log']))}; read {out[name]['log']}")
            if time.monotonic() > deadline:
                raise SiteError(f"dockerd on {name} does not answer on {out[name]['socket']} after {timeout:.0f}s; read {out[name]['log']}")
            time.sleep(0.2)

    with concurrent.futures.ThreadPoolExecutor(len(out)) as ex:
        versions = {name: ex.submit(answers, name) for name in out}
        for name, fut in versions.items():
            out[name]["version"] = fut.result()
    return out


def push_image(bed: "tb.Testbed", registry: str, local_ref: str, tag: str, timeout: float = 900) -> dict:
    """``buildah push`` from inside the controller to ``registry``; returns the pushed reference."""
    dest = f"{registry}/{tag}"
    t0 = time.monotonic()
    # Uncompressed layers: gzipping the image's layers keeps a core busy for long, every pull would pay
    # to inflate them again, and the registry and the nodes sit on the same machine.
    p = bed.exec(
        bed.controller.name,
        "buildah",
        "push",
        "--quiet",
        "--tls-verify=false",
        "--disable-compression",
        "--format",
        "v2s2",
        local_ref,
        f"docker://{dest}",
        env=image_env(),
        timeout=timeout,
        check=False,
    )
    if p.returncode != 0:
        raise SiteError(f"buildah push {local_ref} -> {dest} failed: {(p.stderr or p.stdout).strip()[-600:]}")
    return {"ref": dest, "local_ref": local_ref, "push_seconds": round(time.monotonic() - t0, 1)}


def start_site(
    bed: "tb.Testbed",
    docker: bool = True,
    registry: bool = True,
    image: bool = True,
    registry_data: Optional[os.PathLike] = None,
    log=lambda msg: print(msg, file=sys.stderr),
) -> dict:
    """Registry (controller), dockerd (every node), image pushed; recorded in ``bed.site`` and returned:
    {"registry": {"address", "pid", "data", ...}, "docker": {host: {"socket", "pid", "data_root", ...}},
    "image": {"ref", "local_ref", "push_seconds"}, "seconds": {step: s}}."""
    why = missing_site_requirements(docker, registry, image)
    if why:
        raise SiteError("; ".join(why))
    if (registry or image) and bed.controller is None:
        raise SiteError("--registry/--image need the controller: add --site")
    if image and not registry:
        raise SiteError("--image pushes to the registry: add --registry")
    site = dict(bed.site or {})
    bed.site = site
    t0 = time.monotonic()
    seconds = site.setdefault("seconds", {})
    local_ref = ensure_cpu_image(log) if image else None  # before any daemon: may take minutes
    seconds["image_ready"] = round(time.monotonic() - t0, 1)
    try:
        if registry:
            mark = time.monotonic()
            site["registry"] = start_registry(bed, registry_data)
            bed.save()
            seconds["registry"] = round(time.monotonic() - mark, 2)
        if docker:
            mark = time.monotonic()
            site["docker"] = {}
            site["docker"] = start_dockerds(bed, insecure_registry=site.get("registry", {}).get("address"))
            bed.save()
            seconds["dockerd"] = round(time.monotonic() - mark, 2)
        if image:
            site["image"] = push_image(bed, site["registry"]["address"], local_ref, cpu_image_tag())
            seconds["push"] = site["image"]["push_seconds"]
    finally:
        bed.save()
    return site


def _kill_wait(pid: Optional[int], exe: str, timeout: float) -> str:
    """SIGTERM ``pid`` if it is still ``exe``, wait, SIGKILL after ``timeout``."""
    if not pid or not tb.pid_alive(pid) or os.path.realpath(tb.exe_of(pid)) != os.path.realpath(exe):
        return "gone"
    os.kill(pid, signal.SIGTERM)
    try:
        tb.wait_for(lambda: not tb.pid_alive(pid), timeout, f"{exe} {pid} to exit")
        return "stopped"
    except tb.TestbedError:
        os.kill(pid, signal.SIGKILL)
        return "killed"


def stop_site(bed: "tb.Testbed", timeout: float = 20) -> List[str]:
    """Containers removed, every dockerd and the registry stopped by PID, exec-roots removed.
    Never raises (``down`` kills what is left with the hosts); returns what it did."""
    site = bed.site or {}
    done = []
    dockers = site.get("docker") or {}

    def stop_docker(name, d):
        ids = docker(bed, name, "ps", "-aq", timeout=30, check=False).stdout.split() if tb.pid_alive(d.get("pid")) else []
        if ids:
            docker(bed, name, "rm", "-f", *ids, timeout=60, check=False)
        return f"dockerd {name}: {len(ids)} containers removed, {_kill_wait(d.get('pid'), DOCKERD, timeout)}"

    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(dockers))) as ex:
            for line in ex.map(lambda kv: stop_docker(*kv), dockers.items()):
                done.append(line)
    except Exception as e:  # keep going: the hosts die next anyway
        done.append(f"dockerd: {e}")
    reg = site.get("registry") or {}
    if reg:
        done.append(f"registry: {_kill_wait(reg.get('pid'), REGISTRY, timeout)}")
    run_dir = Path(f"/run/{bed.prefix}-docker")
    if run_dir.exists():
        for m in reversed(tb.mounts_under([str(run_dir)])):
            subprocess.run(["umount", "-l", m], capture_output=True, timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)
        done.append(f"removed {run_dir}")
    bed.site = None
    try:
        bed.save()
    except OSError:
        pass
    return done


# ---- the layer: how the core and `scripts/testbed up --site ...` reach this module -------------------
def add_arguments(up) -> None:
    site = up.add_argument_group("A user's site (scripts/kit_testbed/site_layer.py)")
    site.add_argument("--site", action="store_true", help=f"controller `{tb.CONTROLLER_NAME}` on {tb.ADMIN_SUBNET}, routed to the nodes")
    site.add_argument("--docker", action="store_true", help="dockerd in every node host (stopped by PID on down)")
    site.add_argument("--registry", action="store_true", help="image registry on the controller (needs --site)")
    site.add_argument(
        "--image", action="store_true", help="push the modern CPU image to the registry (needs --registry; builds it if missing)"
    )
    site.add_argument(
        "--registry-data",
        metavar="DIR",
        default=None,
        help="registry blob store (default <state>/registry/data, removed by down; a kept DIR makes the next push nearly free)",
    )


def check_arguments(args, usage_error) -> None:
    if (args.registry or args.image) and not args.site:
        usage_error("--registry and --image live on the controller: add --site")
    if args.image and not args.registry:
        usage_error("--image pushes to the registry: add --registry")
    why = missing_site_requirements(args.docker, args.registry, args.image)
    if why:
        raise tb.TestbedError("; ".join(why))


def host_options(args) -> dict:
    """The controller and router (``--site``); the cgroup hierarchies in every node host (dockerd needs them)."""
    return {"site": args.site, "cgroups": args.docker}


def start_from_arguments(bed: "tb.Testbed", args) -> None:
    if (args.docker or args.registry) and not bed.site:  # (a reused bed keeps the site it has)
        start_site(bed, docker=args.docker, registry=args.registry, image=args.image, registry_data=args.registry_data)


def summary(bed: "tb.Testbed") -> Optional[dict]:
    return bed.site or None


def stop_layer(bed: Optional["tb.Testbed"], prefix: str, graceful: bool) -> List[str]:
    if bed and bed.site:
        return stop_site(bed)
    run_dir = Path(f"/run/{prefix}-docker")
    if run_dir.exists():  # a crashed site: its dockerds' exec-roots
        shutil.rmtree(run_dir, ignore_errors=True)
        return [f"removed {run_dir}"]
    return []


# Before Ray: it is brought up first (the image push may take minutes) and stopped after it.
LAYER = tb.register_layer(
    tb.Layer(
        name="site",
        order=10,
        add_arguments=add_arguments,
        check_arguments=check_arguments,
        host_options=host_options,
        start=start_from_arguments,
        summary=summary,
        stop=stop_layer,
    )
)
