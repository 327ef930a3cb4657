"""Fixtures for multi-host doctor / training tests (tests/test_doctor.py, tests/test_multihost.py).

* ``mgmt_cluster`` -> ``MgmtCluster``: its own 2-host bed (tag "mgmt"): head and w1 each have a
  management NIC (192.168.77.0/24) holding the DEFAULT ROUTE, so Ray's own IP guess would pick the
  wrong network. Only the head runs Ray, started with the node IP that
  ``alpa_job.cluster.node_ip.select_node_ip(cidr)`` chose INSIDE the head. No firewall. Tests start
  (and must stop) w1 themselves: ``.start_worker(node_ip)`` / ``.stop_worker()``.
* ``run_doctor(bed, host, address, spec_path, *extra, timeout=90)`` -> (rc, parsed json or None,
  CompletedProcess, seconds): ``python -m alpa_job doctor --format json`` inside a host.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import pytest

from alpa_job.cluster.ray_api import gcs_address

NUM_CPUS = 1
OBJECT_STORE = 100_000_000


def run_doctor(bed, host: str, address: str, spec_path, *extra, timeout: float = 90):
    t0 = time.monotonic()
    p = bed.exec(
        host,
        "python",
        "-m",
        "alpa_job",
        "doctor",
        "--address",
        address,
        "--cluster-spec",
        str(spec_path),
        "--format",
        "json",
        *extra,
        timeout=timeout,
        check=False,
    )
    seconds = time.monotonic() - t0
    try:
        data = json.loads(p.stdout)
    except ValueError:
        data = None
    return p.returncode, data, p, seconds


class MgmtCluster:
    def __init__(self, bed, spec, spec_path: Path, head_node_ip: str):
        self.testbed = bed
        self.spec = spec
        self.spec_path = spec_path
        self.head_node_ip = head_node_ip
        self.address = gcs_address(spec, head_node_ip)

    def alive(self, want: int, timeout: float = 30) -> list:
        p = self.testbed.exec(
            "head",
            "python",
            "-m",
            "alpa_job.cluster.wait_nodes",
            "--count",
            str(want),
            "--timeout",
            str(timeout),
            timeout=timeout + 60,
            env={"RAY_ADDRESS": self.address},
            check=False,
        )  # fewer than `want` is an answer too
        reports = [x for x in p.stdout.splitlines() if x.startswith("{")]
        assert reports, "wait_nodes printed no report (rc=%d): %s" % (p.returncode, p.stderr[-2000:])
        return json.loads(reports[-1])["alive"]

    def start_worker(self, node_ip: Optional[str] = None):
        """Start Ray on w1 with `node_ip` as --node-ip-address (default: its cluster IP)."""
        from alpa_job.cluster.ray_start import ray_start_args

        w1 = self.testbed.host("w1")
        argv = ray_start_args(self.spec, "worker", w1.ip, head_ip=self.head_node_ip, num_cpus=NUM_CPUS, object_store_memory=OBJECT_STORE)
        if node_ip is not None:  # ray_start_args refuses an IP outside the CIDR: this is the mistake
            argv = [("--node-ip-address=%s" % node_ip if a.startswith("--node-ip-address=") else a) for a in argv]
        return self.testbed.exec("w1", *argv, timeout=90)

    def stop_worker(self):
        self.testbed.exec("w1", "ray", "stop", "--force", timeout=60, check=False)


@pytest.fixture(scope="session")
def mgmt_cluster(testbed_factory):
    pytest.importorskip("ray")
    from alpa_job.cluster.ray_start import ray_start_args
    from alpa_job.cluster.spec import load_spec

    bed = testbed_factory(2, mgmt=("head", "w1"), tag="mgmt", held=True)
    spec_path = bed.state_dir / "cluster-spec-mgmt.yaml"
    spec_path.write_text("cluster_cidr: %s\n" % bed.subnet)
    spec = load_spec(str(spec_path))
    try:
        # The node IP is chosen inside the head, by the kit, from the CIDR (not by Ray's route guess).
        node_ip = bed.exec("head", "python", "-m", "alpa_job.cluster.node_ip", "--cidr", bed.subnet).stdout.strip()
        bed.exec(
            "head",
            *ray_start_args(spec, "head", node_ip, num_cpus=NUM_CPUS, object_store_memory=OBJECT_STORE, include_dashboard=False),
            timeout=120,
        )
        cluster = MgmtCluster(bed, spec, spec_path, node_ip)
    except BaseException:
        bed.down()
        raise
    yield cluster
    bed.down()
