"""A real image build: the modern image's CPU variant, built with buildah and run with podman.

No Docker engine and no registry: a Debian 12 base made with debootstrap, buildah + podman + runc
(the recipe and every pitfall: docker/README.md and the project's images notes). The build installs the
hashed lock from PyPI (the only network it needs); the run needs no network.

Cache (survives within one CI run; delete it to start over): $ALPA_KIT_IMAGE_CACHE, default
/var/tmp/alpa-cluster-kit-images: the debootstrap tarball and the container storage (layer cache).
Skips, saying why, only when not root or when buildah/podman/runc/debootstrap cannot be installed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from alpa_job.cluster.spec import load_spec

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = {"buildah": "buildah", "podman": "podman", "runc": "runc", "debootstrap": "debootstrap"}
BASE = "localhost/debian:bookworm"
CONTAINERS_CONF = """\
[containers]
netns = "host"
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def _log(msg):
    sys.stderr.write("[image-build] %s\n" % msg)


def _run(cmd, timeout, **kw):
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    return result, time.monotonic() - start


def _ensure_tools():
    missing = [pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _log("apt-get install %s" % " ".join(missing))
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
        result, _ = _run(cmd, 600, env=env)
        if result.returncode != 0:
            pytest.skip("cannot install %s with apt-get: %s" % (" ".join(missing), result.stderr.strip()[-300:]))
    still = [tool for tool in TOOLS if shutil.which(tool) is None]
    if still:
        pytest.skip("apt-get installed %s but %s is still missing" % (" ".join(missing), " ".join(still)))


@pytest.fixture(scope="session")
def podman_env():
    """Tools installed, the config files written, the debootstrap base imported. Returns the env to use."""
    if os.geteuid() != 0:
        pytest.skip("needs root: debootstrap, buildah --isolation chroot and podman run as root")
    _ensure_tools()
    cache = os.environ.get("ALPA_KIT_IMAGE_CACHE", "/var/tmp/alpa-cluster-kit-images")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, "containers.conf"), "w") as f:
        f.write(CONTAINERS_CONF)
    with open(os.path.join(cache, "storage.conf"), "w") as f:
        f.write('[storage]\ndriver = "overlay"\ngraphroot = "%s/storage"\nrunroot = "%s/run"\n' % (cache, cache))
    env = {**os.environ, "CONTAINERS_CONF": os.path.join(cache, "containers.conf"),
           "CONTAINERS_STORAGE_CONF": os.path.join(cache, "storage.conf"), "PYTHON": sys.executable}
    # Behind a TLS-intercepting proxy pip needs the host's CA bundle during the build (mounted, not baked in).
    if not env.get("PIP_CERT") and os.path.exists("/etc/ssl/certs/ca-certificates.crt"):
        env["PIP_CERT"] = "/etc/ssl/certs/ca-certificates.crt"

    exists, _ = _run(["podman", "image", "exists", BASE], 60, env=env)
    if exists.returncode != 0:
        tarball = os.path.join(cache, "debian-bookworm-minbase.tar")
        if not os.path.exists(tarball):
            rootfs = os.path.join(cache, "rootfs")
            shutil.rmtree(rootfs, ignore_errors=True)
            result, took = _run(["debootstrap", "--variant=minbase", "bookworm", rootfs,
                                 "http://deb.debian.org/debian"], 900)
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
            _log("debootstrap: %.0f s" % took)
            for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for name in os.listdir(os.path.join(rootfs, sub)):
                    path = os.path.join(rootfs, sub, name)
                    if os.path.isfile(path):
                        os.remove(path)
            result, _ = _run(["tar", "-C", rootfs, "-cf", tarball + ".part", "."], 300)
            assert result.returncode == 0, result.stderr
            os.rename(tarball + ".part", tarball)
            shutil.rmtree(rootfs, ignore_errors=True)
        result, took = _run(["podman", "import", tarball, BASE], 300, env=env)
        assert result.returncode == 0, result.stderr
        _log("podman import: %.0f s" % took)
    return env


@pytest.fixture(scope="session")
def cpu_image(podman_env):
    tag = load_spec().images["jax_cpu"]
    result, took = _run([os.path.join(REPO, "scripts", "build-images"), "--cpu", "--base", BASE], 1500,
                        env=podman_env)
    assert result.returncode == 0, "build failed:\n%s\n%s" % (result.stdout[-6000:], result.stderr[-3000:])
    _log("build: %.0f s" % took)
    return tag


def _podman_run(env, tag, *argv, timeout=600):
    cmd = ["podman", "run", "--rm", "--shm-size=2g", "--network", "host", "--runtime", "runc",
           "--cgroup-manager", "cgroupfs", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096",
           tag, *argv]
    return _run(cmd, timeout, env=env)


def test_cpu_image_trains(podman_env, cpu_image):
    result, took = _podman_run(podman_env, cpu_image, "python", "-m", "alpa_job", "train", "--steps", "3",
                               "--address", "none", "--devices", "2", "--out", "/tmp/run")
    _log("run (train --steps 3): %.0f s" % took)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_cpu_image_layout(podman_env, cpu_image):
    """What KubeRay and the cluster need: the stack's versions, the venv on PATH for `bash -c` AND
    `bash -lc`, a non-root user, token auth on, the spec's XLA port range, pip's view consistent."""
    spec = load_spec()
    script = ("set -e; echo \"uid=$(id -u)\"; echo \"c=$(command -v python)\"; "
              "echo \"lc=$(bash -lc 'command -v python')\"; echo \"auth=$RAY_AUTH_MODE\"; "
              "echo \"xla=$XLA_SERVER_PORT_START-$XLA_SERVER_PORT_END\"; pip check >/dev/null && echo pipcheck=ok; "
              "python -c 'import json, ray, jax, flax; "
              "print(\"versions=\" + json.dumps([ray.__version__, jax.__version__, flax.__version__]))'; "
              "python -c 'import importlib.util as u; print(\"cuda=\" + str(u.find_spec(\"jax_cuda12_plugin\") is not None))'")
    result, _ = _podman_run(podman_env, cpu_image, "bash", "-c", script)
    assert result.returncode == 0, result.stdout + result.stderr
    got = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    xla = spec.xla_env()
    assert got["uid"] == "1000"
    assert got["c"] == got["lc"] == "/opt/venv/bin/python"
    assert got["auth"] == "token"
    assert got["xla"] == "%s-%s" % (xla["XLA_SERVER_PORT_START"], xla["XLA_SERVER_PORT_END"])
    assert got["pipcheck"] == "ok"
    assert json.loads(got["versions"]) == [spec.versions["ray_modern"], spec.versions["jax_modern"],
                                           spec.versions["flax_modern"]]
    assert got["cuda"] == "False"  # the CPU variant carries no CUDA wheels


def test_cpu_image_size(podman_env, cpu_image):
    result, _ = _run(["podman", "image", "inspect", "--format", "{{.Size}}", cpu_image], 60, env=podman_env)
    size = int(result.stdout.strip())
    _log("image size: %.2f GB" % (size / 1e9))
    assert size < 2.0e9, "the CPU image grew to %.2f GB (no CUDA, no caches expected)" % (size / 1e9)
