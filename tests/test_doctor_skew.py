"""End to end: `python -m alpa_job doctor` catches a REAL version skew between two test-bed nodes.

No fakes: a real, different `jax` wheel from PyPI (the venv's jax +/- one patch release) is installed
with ``pip install --no-deps --target DIR`` and put first on w1's Python path (PYTHONPATH=DIR in
the environment of w1's ``ray start``), so w1's Ray workers -- and the doctor's probe pinned there --
read that jax's dist-info through importlib.metadata (``versions.collect()``). jax is one of
doctor.VERSION_KEYS (optax, flax, ... are collected but not compared). Nothing imports jax here, so
its jaxlib pin does not matter.

Own 2-host bed (tag "skew": head + w1, no firewall), torn down at the end; the shared beds stay
untouched. The same bed is first checked green WITHOUT the skew, then w1 is restarted with it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from alpa_job import versions
from alpa_job.cluster.doctor import checks as doctor
from alpa_job.errors import EXIT_CHECK_FAILED
from fixtures_multihost import run_doctor
from fixtures_testbed import RAY_FORM_TIMEOUT, RayCluster

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "jax"
DOCTOR_MAX_S = 30.0


def _skew_version(installed: str) -> str:
    """A real released version other than the installed one (patch - 1, or + 1 at .0)."""
    parts = installed.split(".")
    if len(parts) < 3 or not all(p.isdigit() for p in parts[:3]):
        pytest.skip("cannot derive a neighbouring release of %s %s" % (PACKAGE, installed))
    major, minor, patch = (int(p) for p in parts[:3])
    return "%d.%d.%d" % (major, minor, patch - 1 if patch > 0 else patch + 1)


def _skewed_site(tmp_path: Path, version: str) -> Path:
    """DIR with the real jax==version (--no-deps); skip with the reason if PyPI cannot be reached."""
    wheels = tmp_path / "wheels"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            str(wheels),
            "%s==%s" % (PACKAGE, version),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    found = sorted(wheels.glob("%s-%s-*.whl" % (PACKAGE, version))) if wheels.is_dir() else []
    if p.returncode != 0 or not found:
        pytest.skip(
            "pip download %s==%s failed (PyPI unreachable?): %s" % (PACKAGE, version, (p.stderr.strip().splitlines() or ["no wheel"])[-1])
        )
    site = tmp_path / "skew-site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(found[0]),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    assert (site / ("%s-%s.dist-info" % (PACKAGE, version))).is_dir(), sorted(p.name for p in site.iterdir())
    return site


def _version_checks(data: dict) -> list:
    return [c for c in data["checks"] if c["name"] == "versions"]


def _wait_formed(cluster: RayCluster, what: str) -> dict:
    """Every bed IP alive exactly once (a restarted node's old entry must be dead) and answering."""
    deadline = time.monotonic() + RAY_FORM_TIMEOUT
    while True:
        result = cluster.check(timeout=max(5.0, deadline - time.monotonic()))
        if cluster.healthy(result) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert cluster.healthy(result), "%s: cluster did not form: %s (logs under %s/hosts)" % (what, result, cluster.testbed.state_dir)
    return result


@pytest.mark.testbed
@pytest.mark.slow
def test_doctor_catches_a_real_package_skew_on_one_worker(testbed_factory, tmp_path):
    pytest.importorskip("ray")
    from alpa_job.cluster.ray_start import ray_start_args
    from alpa_job.cluster.spec import load_spec

    assert PACKAGE in doctor.VERSION_KEYS and PACKAGE in versions.PACKAGES
    ref = versions.package_version(PACKAGE)
    if ref is None:
        pytest.skip("%s is not installed in this venv" % PACKAGE)
    skew = _skew_version(ref)
    site = _skewed_site(tmp_path, skew)

    bed = testbed_factory(2, tag="skew")
    try:
        spec_path = bed.state_dir / "cluster-spec.yaml"
        spec_path.write_text("cluster_cidr: %s\n" % bed.subnet)
        spec = load_spec(str(spec_path))
        cluster = RayCluster(bed, spec, spec_path)
        head, w1 = bed.head, bed.host("w1")

        def start(host, role, env=None):
            argv = ray_start_args(
                spec, role, host.ip, head_ip=head.ip, num_cpus=1, object_store_memory=100_000_000, include_dashboard=role == "head"
            )
            p = bed.exec(host.name, *argv, timeout=RAY_FORM_TIMEOUT, check=False, env=env)
            assert p.returncode == 0, "ray start (%s) rc=%d:\n%s\n%s" % (host.name, p.returncode, p.stdout[-3000:], p.stderr[-3000:])

        start(head, "head")
        start(w1, "worker")
        _wait_formed(cluster, "no skew")

        # 1. the same bed without the skew: green on versions (and overall)
        rc, data, p, green_s = run_doctor(bed, "head", cluster.address, spec_path)
        assert data is not None, (p.stdout[-3000:], p.stderr[-3000:])
        vchecks = _version_checks(data)
        assert vchecks and all(c["ok"] for c in vchecks), vchecks
        assert any(c["detail"] == "%s %s on every node" % (PACKAGE, ref) for c in vchecks), vchecks
        assert rc == 0 and data["ok"] is True, [c for c in data["checks"] if not c["ok"]]
        assert data["nodes"][w1.ip]["versions"][PACKAGE] == ref

        # 2. w1 restarted with the real other jax first on its Python path
        # graceful stop: the raylet unregisters, so the head sees the old w1 dead at once
        bed.exec("w1", "ray", "stop", timeout=60, check=False)
        start(w1, "worker", env={"PYTHONPATH": "%s:%s" % (site, REPO)})
        _wait_formed(cluster, "w1 restarted with %s %s" % (PACKAGE, skew))
        # what w1's Ray workers really see (a plain task pinned there, no doctor involved)
        seen = cluster.run_python(
            "import os, ray\nfrom alpa_job.cluster.ray_api import join_ray, pin_to_node\n"
            "join_ray(os.environ['RAY_ADDRESS'], log_to_driver=False)\n"
            "f = ray.remote(num_cpus=0)(lambda: __import__('importlib.metadata').metadata.version('%s'))\n"
            "print('SEEN', ray.get(f.options(**pin_to_node('%s')).remote(), timeout=60))" % (PACKAGE, w1.ip),
            timeout=120,
        ).stdout
        assert "SEEN %s" % skew in seen, seen

        rc, data, p, seconds = run_doctor(bed, "head", cluster.address, spec_path)
        print("doctor wall time: %.1f s green, %.1f s with the skew" % (green_s, seconds))
        assert seconds < DOCTOR_MAX_S, "doctor took %.1f s" % seconds
        assert data is not None, (p.stdout[-3000:], p.stderr[-3000:])
        assert rc == EXIT_CHECK_FAILED, (rc, p.stderr[-2000:])
        assert data["ok"] is False
        assert data["nodes"][w1.ip]["versions"][PACKAGE] == skew
        assert data["nodes"][head.ip]["versions"][PACKAGE] == ref
        failed = [c for c in data["checks"] if not c["ok"]]
        assert failed and all(c["name"] == "versions" for c in failed), failed  # nothing else broke
        bad = [c for c in failed if c["node"] == w1.ip and c["detail"].startswith(PACKAGE + " ")]
        assert len(bad) == 1, failed
        assert bad[0]["detail"] == "%s %s here, %s on %s" % (PACKAGE, skew, ref, head.ip), bad[0]
        assert "install %s %s on %s" % (PACKAGE, ref, w1.ip) in bad[0]["fix"], bad[0]
        # the one-line summary on stderr names the node, the package and both versions too
        assert w1.ip in p.stderr and "%s %s here, %s" % (PACKAGE, skew, ref) in p.stderr, p.stderr
    finally:
        bed.down()
