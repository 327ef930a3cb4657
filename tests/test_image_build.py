"""A real image build: the modern image's CPU variant, built with buildah and run with podman.

No Docker engine and no registry: a Debian 12 base made with debootstrap, buildah + podman + runc
(the recipe and every pitfall: docker/README.md and the project's images notes). The build installs the
hashed lock from PyPI (the only network it needs); the run needs no network.

Cache (kept for as long as the machine keeps it; delete it to start over): $ALPA_KIT_IMAGE_CACHE, default
/var/tmp/alpa-cluster-kit-images: the debootstrap tarball and the container storage, whose layers the next
build reuses up to its first changed step.
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
from kit_testbed.site_layer import ensure_cpu_image, image_cache_lock

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
    env = {
        **os.environ,
        "CONTAINERS_CONF": os.path.join(cache, "containers.conf"),
        "CONTAINERS_STORAGE_CONF": os.path.join(cache, "storage.conf"),
        "PYTHON": sys.executable,
    }
    # Behind a TLS-intercepting proxy pip needs the host's CA bundle during the build (mounted, not baked in).
    if not env.get("PIP_CERT") and os.path.exists("/etc/ssl/certs/ca-certificates.crt"):
        env["PIP_CERT"] = "/etc/ssl/certs/ca-certificates.crt"

    with image_cache_lock():  # the site bed's image build may be making the same base now
        _import_base(env, cache)
    return env


def _import_base(env, cache):
    exists, _ = _run(["podman", "image", "exists", BASE], 60, env=env)
    if exists.returncode != 0:
        tarball = os.path.join(cache, "debian-bookworm-minbase.tar")
        if not os.path.exists(tarball):
            rootfs = os.path.join(cache, "rootfs")
            shutil.rmtree(rootfs, ignore_errors=True)
            result, took = _run(["debootstrap", "--variant=minbase", "bookworm", rootfs, "http://deb.debian.org/debian"], 900)
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


@pytest.fixture(scope="session")
def cpu_image(podman_env):
    """scripts/build-images --cpu, through the one builder the site bed uses too (it records what the image
    bakes in, so whichever of the two comes first builds it and the other finds it current)."""
    tag = load_spec().images["jax_cpu"]
    started = time.monotonic()
    ensure_cpu_image(log=_log)
    _log("build (or found current): %.0f s" % (time.monotonic() - started))
    return tag


def _podman_run(env, tag, *argv, timeout=600):
    cmd = [
        "podman",
        "run",
        "--rm",
        "--shm-size=2g",
        "--network",
        "host",
        "--runtime",
        "runc",
        "--cgroup-manager",
        "cgroupfs",
        "--ulimit",
        "nofile=20000:20000",
        "--ulimit",
        "nproc=4096:4096",
        tag,
        *argv,
    ]
    return _run(cmd, timeout, env=env)


def test_cpu_image_trains(podman_env, cpu_image):
    result, took = _podman_run(
        podman_env,
        cpu_image,
        "python",
        "-m",
        "alpa_job",
        "train",
        "--steps",
        "3",
        "--address",
        "none",
        "--devices",
        "2",
        "--out",
        "/tmp/run",
    )
    _log("run (train --steps 3): %.0f s" % took)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_cpu_image_layout(podman_env, cpu_image):
    """What KubeRay and the cluster need: the stack's versions, the venv on PATH for `bash -c` AND
    `bash -lc`, a non-root user, token auth on, the spec's XLA port range, pip's view consistent."""
    spec = load_spec()
    script = (
        'set -e; echo "uid=$(id -u)"; echo "c=$(command -v python)"; '
        'echo "lc=$(bash -lc \'command -v python\')"; echo "auth=$RAY_AUTH_MODE"; '
        'echo "xla=$XLA_SERVER_PORT_START-$XLA_SERVER_PORT_END"; pip check >/dev/null && echo pipcheck=ok; '
        "python -c 'import json, ray, jax, flax; "
        'print("versions=" + json.dumps([ray.__version__, jax.__version__, flax.__version__]))\'; '
        'python -c \'import importlib.util as u; print("cuda=" + str(u.find_spec("jax_cuda12_plugin") is not None))\''
    )
    result, _ = _podman_run(podman_env, cpu_image, "bash", "-c", script)
    assert result.returncode == 0, result.stdout + result.stderr
    got = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    xla = spec.xla_env()
    assert got["uid"] == "1000"
    assert got["c"] == got["lc"] == "/opt/venv/bin/python"
    assert got["auth"] == "token"
    assert got["xla"] == "%s-%s" % (xla["XLA_SERVER_PORT_START"], xla["XLA_SERVER_PORT_END"])
    assert got["pipcheck"] == "ok"
    assert json.loads(got["versions"]) == [spec.versions["ray_modern"], spec.versions["jax_modern"], spec.versions["flax_modern"]]
    assert got["cuda"] == "False"  # the CPU variant carries no CUDA wheels


def test_cpu_image_size(podman_env, cpu_image):
    result, _ = _run(["podman", "image", "inspect", "--format", "{{.Size}}", cpu_image], 60, env=podman_env)
    size = int(result.stdout.strip())
    _log("image size: %.2f GB" % (size / 1e9))
    assert size < 2.0e9, "the CPU image grew to %.2f GB (no CUDA, no caches expected)" % (size / 1e9)


# ------------------------------------------- the Alpa image's recipe on Ubuntu 20.04 (without CUDA)

FOCAL = "localhost/ubuntu:focal"
UBUNTU_MIRROR = "http://archive.ubuntu.com/ubuntu"


def alpa_recipe_without_cuda(text):
    """docker/alpa/Dockerfile with ONLY what cannot exist here swapped out: the nvidia/cuda base (-> an
    Ubuntu 20.04 debootstrap base with the same apt sources), NCCL (comes with that base) and Alpa's
    CUDA jaxlib (-> a metadata-only stand-in of the same version, so `pip check` and the version guard
    run). Every other line -- apt pins, pip bootstrap, hashed lock, guard, layout -- is the real one."""

    def swap(old, new, count=1):
        nonlocal text
        assert text.count(old) == count, "docker/alpa/Dockerfile changed; update this test: %r" % old
        text = text.replace(old, new)

    swap(
        "FROM nvidia/cuda:11.3.1-cudnn8-devel-ubuntu20.04\n",
        "FROM %s\nRUN printf 'deb %s focal main universe\\ndeb %s focal-updates main universe\\n"
        "deb %s focal-security main universe\\n' > /etc/apt/sources.list \\\n"
        " && apt-get update && apt-get install -y --no-install-recommends ca-certificates"
        " && rm -rf /var/lib/apt/lists/*\n" % ((FOCAL,) + (UBUNTU_MIRROR,) * 3),
    )
    swap('      "libnccl2=${NCCL_PACKAGE_VERSION}" "libnccl-dev=${NCCL_PACKAGE_VERSION}" \\\n', "")
    swap(" && apt-mark hold libnccl2 libnccl-dev \\\n", "")
    swap(' && test "$(dpkg-query -W -f \'${Version}\' libnccl2)" = "${NCCL_PACKAGE_VERSION}" \\\n', "")
    start = text.index(" && mkdir /tmp/jaxlib \\\n")
    end_marker = ' && /opt/venv/bin/pip install --no-cache-dir --no-deps "${whl}" \\\n'
    end = text.index(end_marker) + len(end_marker)
    standin = "/opt/venv/lib/python3.9/site-packages/jaxlib-${JAXLIB_VERSION}.dist-info"
    text = (
        text[:start]
        + (
            " && mkdir -p %s \\\n"
            " && printf 'Metadata-Version: 2.1\\nName: jaxlib\\nVersion: %%s\\nRequires-Dist: scipy (>=1.5)\\n"
            'Requires-Dist: numpy (>=1.20)\\n\' "${JAXLIB_VERSION}" > %s/METADATA \\\n'
            " && echo stand-in > %s/INSTALLER && touch %s/RECORD \\\n" % ((standin,) * 4)
        )
        + text[end:]
    )
    return text


@pytest.fixture(scope="session")
def focal_base(podman_env):
    exists, _ = _run(["podman", "image", "exists", FOCAL], 60, env=podman_env)
    if exists.returncode == 0:
        return FOCAL
    probe, _ = _run(["curl", "-sSf", "-o", "/dev/null", "-m", "20", UBUNTU_MIRROR + "/dists/focal/Release"], 60)
    if probe.returncode != 0:
        pytest.skip("Ubuntu's archive (%s) is not reachable: %s" % (UBUNTU_MIRROR, probe.stderr.strip()))
    cache = os.environ.get("ALPA_KIT_IMAGE_CACHE", "/var/tmp/alpa-cluster-kit-images")
    rootfs = os.path.join(cache, "rootfs-focal")
    shutil.rmtree(rootfs, ignore_errors=True)
    # Debian's debootstrap has the focal script; Ubuntu's archive key is not in Debian's keyring.
    result, took = _run(
        ["debootstrap", "--no-check-gpg", "--variant=minbase", "--components=main,universe", "focal", rootfs, UBUNTU_MIRROR], 900
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    _log("debootstrap focal: %.0f s" % took)
    tar = subprocess.Popen(["tar", "-C", rootfs, "--exclude=./var/cache/apt/archives/*.deb", "-c", "."], stdout=subprocess.PIPE)
    result = subprocess.run(["podman", "import", "-", FOCAL], stdin=tar.stdout, capture_output=True, text=True, timeout=300, env=podman_env)
    tar.wait()
    assert result.returncode == 0, result.stderr
    shutil.rmtree(rootfs, ignore_errors=True)
    return FOCAL


def test_alpa_image_recipe_builds_on_ubuntu_2004(podman_env, focal_base, tmp_path):
    """The Alpa Dockerfile's real apt pins, pip bootstrap, hashed lock (2 sdists built offline from
    hashed setuptools/wheel), `pip check`, version guard and layout, on Ubuntu 20.04 -- only CUDA, NCCL
    and Alpa's jaxlib (metadata stand-in) are not the real ones. Then Ray 2.1.0 starts in it."""
    with open(os.path.join(REPO, "docker", "alpa", "Dockerfile")) as f:
        derived = alpa_recipe_without_cuda(f.read())
    dockerfile = tmp_path / "Dockerfile.alpa-nocuda"
    dockerfile.write_text(derived)
    tag = "localhost/alpa-cluster-kit-test/alpa-recipe:nocuda"
    env = {**podman_env}
    cmd = [
        "buildah",
        "bud",
        "--format",
        "docker",
        "--isolation",
        "chroot",
        "--network",
        "host",
        "--layers",
        "--pull=never",
        "-t",
        tag,
        "-f",
        str(dockerfile),
    ]
    if env.get("PIP_CERT"):
        cmd += ["-v", "%s:/etc/host-ca/ca.crt:ro" % env["PIP_CERT"], "--build-arg", "PIP_CERT=/etc/host-ca/ca.crt"]
    # The same minimal context scripts/build-images makes.
    ctx = tmp_path / "ctx"
    os.makedirs(ctx / "requirements")
    os.makedirs(ctx / "docker")
    for name in os.listdir(os.path.join(REPO, "requirements")):
        if name.startswith("image-"):
            shutil.copy(os.path.join(REPO, "requirements", name), ctx / "requirements" / name)
    shutil.copytree(os.path.join(REPO, "docker", "common"), ctx / "docker" / "common")
    shutil.copytree(os.path.join(REPO, "alpa_job"), ctx / "alpa_job", ignore=shutil.ignore_patterns("__pycache__"))
    result, took = _run(cmd + [str(ctx)], 1500, env=env)
    _log("alpa recipe build (ubuntu 20.04, no CUDA): %.0f s" % took)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    script = (
        'set -e; echo "uid=$(id -u)"; echo "c=$(command -v python)"; echo "ray=$(ray --version)"; '
        "command -v cbc tini wget >/dev/null && echo tools=ok; "
        "python -c 'import ray; ray.init(num_cpus=1, include_dashboard=False); "
        'print("task=%d" % ray.get(ray.remote(lambda: 7).remote()))\''
    )
    result, _ = _podman_run(env, tag, "bash", "-c", script)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert got["uid"] == "1000" and got["c"] == "/opt/venv/bin/python" and got["tools"] == "ok"
    assert got["ray"] == "ray, version %s" % load_spec().versions["ray_legacy"]
    assert got["task"] == "7"
    # The image stays in the cache: its layers are the next build's (a changed recipe, lock or kit rebuilds from
    # the first changed step, as any Docker build does); the layers of the image it replaced are removed.
    with image_cache_lock():  # not while the site's CPU image builds: its newest layer has no tag yet either
        _run(["podman", "image", "prune", "-f"], 300, env=env)
