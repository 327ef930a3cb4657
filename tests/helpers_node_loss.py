"""The node-loss test bed, shared by the modules that kill hosts, stop jobs and hang processes on it
(test_node_loss, test_preemption_testbed, test_watchdog_testbed): its Ray cluster and the job they train."""

from __future__ import annotations

import uuid
from pathlib import Path

EVERY = 10
STEPS = 40  # the kill comes after checkpoint 20: the restart has steps left to run on the survivors
BATCH = 96  # divides 3 x 2 and 2 x 2 devices


def _cluster(testbed_factory):
    """A 3-host Ray cluster on its own bed (tag nodeloss). A worker host a test killed is started anew and
    its Ray joins the cluster again (the bed and the other hosts' Ray stay), as a site replaces a machine."""
    from kit_testbed import ray_layer as testbed_ray
    from fixtures_testbed import _start_ray

    bed = testbed_factory(3, tag="nodeloss", revive=True)
    cached = _CLUSTERS.get(bed.prefix)
    if cached is not None and cached.testbed is bed:
        revived = [h.name for h in bed.hosts if h.pid != _PIDS[bed.prefix].get(h.name)]
        if revived:
            testbed_ray.rejoin(bed, revived, ray_env=FAST_DEATH)
            _PIDS[bed.prefix] = {h.name: h.pid for h in bed.hosts}
            formation = cached.check()
            assert cached.healthy(formation), f"Ray did not form again after reviving {revived}: {formation}"
        return cached
    cluster = _start_ray(bed, ray_env=FAST_DEATH)
    _CLUSTERS[bed.prefix] = cluster
    _PIDS[bed.prefix] = {h.name: h.pid for h in bed.hosts}
    return cluster


_CLUSTERS: dict = {}
_PIDS: dict = {}  # bed prefix -> {host: its PID 1 when its Ray joined}: a new PID 1 is a revived host
# The GCS asks each raylet every second (Ray's default: every 3 s) and marks it dead after 5 missed answers:
# a killed host is listed dead in ~5 s instead of ~15 s. The kit's own waits for that view are unchanged.
FAST_DEATH = {"RAY_health_check_period_ms": "1000"}


# Steps of about a tenth of a second on the bed: the 20 steps after the kill's checkpoint still leave seconds for
# a kill that goes through a CLI (`ray stop` in a host) to land mid-run. A wider MLP only makes every step
# of every run here slower (its data-parallel update is replicated on all 6 devices of 2 cores).
MLP = ("--model", "mlp", "--hidden-dim", "256")


def _train_argv(cluster, out: str, *extra: str, steps: int = STEPS, model=MLP):
    return [
        "python",
        "-m",
        "alpa_job",
        "train",
        *model,
        "--steps",
        str(steps),
        "--devices",
        "2",
        "--batch-size",
        str(BATCH),
        "--checkpoint-every",
        str(EVERY),
        "--address",
        cluster.address,
        "--cluster-spec",
        str(cluster.spec_path),
        "--out",
        out,
        *extra,
    ]


def _out(name: str) -> Path:
    # /tmp outside /tmp/ray is the machine's /tmp, the same folder on every test-bed host: a shared --out.
    path = Path("/tmp") / ("aktg-nodeloss-%s-%s" % (name, uuid.uuid4().hex[:8]))
    path.mkdir()
    return path
