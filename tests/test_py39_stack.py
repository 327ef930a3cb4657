"""The package's non-engine code on the Alpa image's Python stack: Python 3.9 with Ray 2.1.0.

A venv (in the suite's cache, `$ALPA_KIT_IMAGE_CACHE/venvs/`, one per content of its pins: a machine that kept
the cache makes it once) gets the Alpa image's own hashed lock
(requirements/image-alpa.txt: ray[default]==2.1.0, alpa==0.2.3, jax==0.3.22 source, flax 0.6.2, ...)
installed exactly as docker/alpa/Dockerfile does (`--require-hashes --no-deps`), a metadata-only stand-in
for Alpa's jaxlib 0.3.22+cuda113 (not downloadable here) so `pip check` proves the image's closure
consistent, and pytest. Then, in a subprocess under that venv:
- the test files that need no JAX (cluster spec, ray start argv, node IP, firewall, Alpa dump reader, HLO);
- a real local Ray 2.1.0 cluster: ray.init(), a task pinned to the node, the doctor's pure checks.

jax 0.3.22 cannot be imported here (jaxlib 0.3.22 is not on PyPI; its oldest is 0.4.13), so the models
run in a second venv (cached the same way), on the closest installable stack
(docker/alpa/requirements-py39-models.txt: jax/jaxlib 0.4.13, flax 0.7.2, optax 0.2.1, Python 3.9):
flax 0.6.2 itself (Alpa's pin) fails on `nn.initializers.zeros_init`, which it does not have.
Skips when no Python 3.9 is found (pyenv's 3.9.18 on the CI machines).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import textwrap

import pytest
from kit_testbed.site_layer import IMAGE_CACHE, image_cache_lock

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(REPO, "requirements", "image-alpa.txt")
PIP_LOCK = os.path.join(REPO, "requirements", "image-alpa-pip.txt")
# Test tools for Python 3.9 (requirements/dev.txt's pytest needs >= 3.10).
PYTEST_PINS = [
    "pytest==8.3.5",
    "pluggy==1.5.0",
    "iniconfig==2.1.0",
    "exceptiongroup==1.3.0",
    "tomli==2.2.1",
    "pytest-timeout==2.4.0",
]  # packaging, typing-extensions: from the lock
NO_JAX_TESTS = [
    "tests/test_cluster_spec.py",
    "tests/test_ray_start.py",
    "tests/test_node_ip.py",
    "tests/test_firewall.py",
    "tests/test_alpa_dump.py",
    "tests/test_hlo.py",
    "tests/test_ray_api.py",
]
JAXLIB_STANDIN = "0.3.22+cuda113.cudnn820"
MODELS_PINS = os.path.join(REPO, "docker", "alpa", "requirements-py39-models.txt")


def find_python39():
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for cand in [shutil.which("python3.9")] + sorted(glob.glob(os.path.join(root, "versions", "3.9*", "bin", "python3.9"))):
        if cand and subprocess.run([cand, "-c", "import sys; assert sys.version_info[:2] == (3, 9)"], capture_output=True).returncode == 0:
            return cand
    return None


def _cached_venv(base: str, name: str, pins: str, fill) -> str:
    """The python of a venv made by `fill` from `pins`, kept in the suite's cache under a name that holds the
    pins' hash (an older one of the same name is removed when the pins change); one maker at a time, across
    suites that share the cache."""
    root = IMAGE_CACHE / "venvs"
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"{name}-{hashlib.sha256(pins.encode()).hexdigest()[:16]}"
    py = str(venv / "bin" / "python")
    with image_cache_lock(f"venv-{name}"):
        if not (venv / ".complete").exists():
            for old in root.glob(f"{name}-*"):
                shutil.rmtree(old, ignore_errors=True)
            subprocess.run([base, "-m", "venv", str(venv)], check=True)
            fill(py)
            (venv / ".complete").touch()
    return py


def _pip(py, *args, timeout=1200):
    cmd = [py, "-m", "pip", "--disable-pip-version-check", "install", "--quiet", *args]
    if os.environ.get("PIP_CERT"):
        cmd += ["--cert", os.environ["PIP_CERT"]]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, "pip %s failed:\n%s" % (" ".join(args[:6]), result.stderr[-4000:])


def _standin_jaxlib(py):
    """dist-info only: tells pip that Alpa's jaxlib is there (nothing can import it)."""
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    info = os.path.join(site, "jaxlib-%s.dist-info" % JAXLIB_STANDIN)
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(
            "Metadata-Version: 2.1\nName: jaxlib\nVersion: %s\nRequires-Dist: scipy (>=1.5)\n"
            "Requires-Dist: numpy (>=1.20)\nSummary: metadata-only stand-in for Alpa's CUDA jaxlib\n" % JAXLIB_STANDIN
        )
    with open(os.path.join(info, "INSTALLER"), "w") as f:
        f.write("alpa-cluster-kit-test\n")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("".join("jaxlib-%s.dist-info/%s,,\n" % (JAXLIB_STANDIN, n) for n in ("METADATA", "INSTALLER", "RECORD")))


@pytest.fixture(scope="module")
def py39():
    base = find_python39()
    if base is None:
        pytest.skip("no Python 3.9 interpreter (python3.9 on PATH or pyenv's versions/3.9*): the Alpa image's Python")
    stamp_text = open(LOCK).read() + open(PIP_LOCK).read() + repr(PYTEST_PINS) + JAXLIB_STANDIN

    def fill(py):
        # As docker/alpa/Dockerfile does: pip + build backend first, then the lock (sdists built in place).
        _pip(py, "--isolated", "--require-hashes", "--no-deps", "-r", PIP_LOCK)
        _pip(py, "--isolated", "--require-hashes", "--no-deps", "--prefer-binary", "--no-build-isolation", "-r", LOCK)
        _pip(py, "--isolated", "--no-deps", *PYTEST_PINS)
        _standin_jaxlib(py)

    return _cached_venv(base, "py39-ray21", stamp_text, fill)


def test_alpa_image_lock_is_consistent(py39):
    """`pip check` over the Alpa image's lock + Alpa's jaxlib (stand-in): what the image build runs."""
    result = subprocess.run([py39, "-m", "pip", "check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    versions = subprocess.run(
        [
            py39,
            "-c",
            "import importlib.metadata as m; print(' '.join(m.version(p) for p in "
            "('ray', 'alpa', 'jax', 'flax', 'chex', 'optax', 'numpy')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    from alpa_job.cluster.spec import load_spec

    v = load_spec().versions
    assert versions[:4] == [v["ray_legacy"], v["alpa"], v["jax_legacy"], v["flax_legacy"]]


def test_non_engine_tests_pass_on_py39_ray21(py39):
    # GRPC_ENABLE_FORK_SUPPORT=0: test_ray_api's local Ray 2.1 start hangs here otherwise, as in the test below.
    env = {k: val for k, val in os.environ.items() if not k.startswith("PYTEST")} | {"GRPC_ENABLE_FORK_SUPPORT": "0"}
    # addopts replaced: pyproject's run the suite with pytest-xdist, which this venv has no need of.
    result = subprocess.run(
        [py39, "-m", "pytest", "-q", "-o", "addopts=-ra", "-p", "no:cacheprovider", "-m", "not testbed", *NO_JAX_TESTS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
    )
    tail = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout, tail


RAY_SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.environ["REPO"])
    import ray
    from alpa_job.cluster import ray_api
    from alpa_job.cluster.doctor import checks as doctor_checks, probe
    from alpa_job import versions

    assert ray.__version__ == "2.1.0", ray.__version__
    ray_api.join_ray(ray_api.LOCAL, num_cpus=2, include_dashboard=False)
    try:
        (node,) = ray_api.alive_nodes()  # the kit's one reader of Ray 2.1.0's node rows
        assert ray_api.head_ip([node]) == node.ip  # no head marker on 2.1.0: from the GCS address

        @ray.remote
        def where():
            import socket
            return ray.get_runtime_context().node_id.hex(), socket.gethostname()

        # pinned the kit's way (ray_api.pin_to_node: the node:<ip> resource)
        node_id, _ = ray.get(where.options(**ray_api.pin_to_node(node.ip)).remote(), timeout=120)
        assert node_id == node.node_id, (node_id, node.node_id)
        # The doctor's pure checks, on this node's real facts.
        facts = ray.get(ray.remote(probe.node_facts).options(**ray_api.pin_to_node(node.ip)).remote(), timeout=120)
        ip = node.ip
        checks = doctor_checks.check_node_ip("n1", ip, {"lo": [ip]}, "%s/32" % ip)
        other = "127.0.0.0/8" if not ip.startswith("127.") else "10.0.0.0/8"  # a CIDR the node is NOT in
        bad = doctor_checks.check_node_ip("n1", ip, {"lo": [ip]}, other)
        skew = doctor_checks.compare_versions({"a": {"ray": "2.1.0"}, "b": {"ray": "2.2.0"}})
        same = doctor_checks.compare_versions({"a": versions.collect(), "b": versions.collect()})
        print(json.dumps({"facts": sorted(facts), "ok": [c["ok"] for c in checks], "bad": [c["ok"] for c in bad],
                          "skew": [c["ok"] for c in skew], "same": [c["ok"] for c in same],
                          "ray": versions.collect()["ray"]}))
    finally:
        ray.shutdown()
""")


def test_real_ray_210_cluster_and_doctor(py39):
    import json

    # gRPC 1.49's fork handlers: beside a busy test bed, Ray 2.1's start of its monitor hung inside fork_exec
    # (its GCS up, no raylet) with gRPC's threads running; without fork support it starts. Workers import
    # alpa_job too (PYTHONPATH).
    env = {**os.environ, "REPO": REPO, "PYTHONPATH": REPO, "RAY_USAGE_STATS_ENABLED": "0", "GRPC_ENABLE_FORK_SUPPORT": "0"}
    result = subprocess.run([py39, "-c", RAY_SCRIPT], capture_output=True, text=True, timeout=180, env=env, cwd="/")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["ray"] == "2.1.0"
    assert all(out["ok"]) and not all(out["bad"])
    assert not all(out["skew"]) and all(out["same"])


@pytest.fixture(scope="module")
def py39_models():
    base = find_python39()
    if base is None:
        pytest.skip("no Python 3.9 interpreter (python3.9 on PATH or pyenv's versions/3.9*)")

    def fill(py):
        _pip(py, "--isolated", "--no-deps", "--prefer-binary", "-r", MODELS_PINS)  # jax 0.4.13: sdist only

    return _cached_venv(base, "py39-models", open(MODELS_PINS).read(), fill)


@pytest.mark.parametrize("model", ["mlp", "wide_resnet", "gpt"])
def test_models_train_on_py39(py39_models, model, tmp_path):
    """Every model, in-process on 2 emulated devices, on Python 3.9 with jax 0.4.13 / flax 0.7.2."""
    env = {**os.environ, "PYTHONPATH": REPO, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = subprocess.run(
        [
            py39_models,
            "-m",
            "alpa_job",
            "train",
            "--model",
            model,
            "--steps",
            "3",
            "--address",
            "none",
            "--devices",
            "2",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 steps, 1 compile" in result.stdout + result.stderr


_JOIN = r"""
import sys
from alpa_job.errors import KitError
from alpa_job.launch.jax_process import init_distributed
try:
    init_distributed(sys.argv[1], 2, int(sys.argv[2]), timeout_s=30)
    print("JOINED")
except KitError as err:
    print("KITERROR " + str(err))
"""


def test_old_jax_that_cannot_join_processes_is_refused_not_split(py39_models, tmp_path):
    """jax 0.4.13 on CPU accepts jax.distributed.initialize (without the timeout keywords, which it lacks) and
    then leaves every process on its own devices: two real processes on loopback get a one-line refusal
    naming the jax version, instead of each training its own replica under one report."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [py39_models, "-c", _JOIN, "127.0.0.1:%d" % port, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(tmp_path),
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for out, err in outs:
        assert "KITERROR jax 0.4.13 on cpu did not join the 2 JAX processes" in out, out + err[-2000:]
