"""A job that fails inside its JAX process on Ray keeps every node's Ray logs beside its report and says
where (issue 14: "a failed training job prints where its logs were collected").

The failure is a real one a user meets: the checkpoint a `--resume` continues from was damaged on disk.
The driver's checks pass (the run directory holds a checkpoint of the same model), so the JAX process
inside its Ray actor is what fails, and its traceback is only in that worker's log.
"""

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

ARGS = ("--model", "mlp", "--hidden-dim", "32", "--num-samples", "96", "--batch-size", "48", "--devices", "2", "--checkpoint-every", "2")


def _damage_checkpoints(out: str) -> int:
    """Damage every saved step so that only a restore finds it (the array data emptied, the sealed file list
    removed: the driver's check before Ray passes, each process's restore then fails); returns how many
    array files were damaged."""
    from alpa_job.train.checkpoint_files import FILES

    damaged = 0
    for root, _dirs, files in os.walk(os.path.join(out, "checkpoints")):
        if FILES in files:
            os.remove(os.path.join(root, FILES))
        if os.sep + "state" + os.sep in root + os.sep and os.path.basename(root) == "d":
            for name in files:
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(0)
                damaged += 1
    return damaged


def test_failed_cluster_run_collects_every_nodes_logs_and_says_where(ray_cluster):
    bed = ray_cluster.testbed
    # /tmp outside /tmp/ray is shared by every test-bed host: one --out all processes see.
    out = str(Path("/tmp") / ("akt-failed-logs-" + uuid.uuid4().hex[:8]))

    def train(*extra):
        return bed.exec(
            "head",
            "python",
            "-m",
            "alpa_job",
            "train",
            *ARGS,
            "--cluster-spec",
            str(ray_cluster.spec_path),
            "--out",
            out,
            *extra,
            timeout=400,
            check=False,
            env={"RAY_ADDRESS": ray_cluster.address},
        )

    first = train("--steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert _damage_checkpoints(out) > 0

    p = train("--steps", "6", "--resume")
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    logs = os.path.join(out, "logs")
    said = [x for x in p.stderr.splitlines() if "logs of every node collected in" in x]
    assert said and said[-1].rstrip().endswith(logs), p.stderr[-3000:]
    node_dirs = os.listdir(logs)
    assert node_dirs, "no node folder under logs/"
    collected = [name for d in node_dirs for name in os.listdir(os.path.join(logs, d))]
    assert len(node_dirs) == len(ray_cluster.node_ips), node_dirs  # every node, not just the head
    assert any(name.startswith("raylet") for name in collected), collected
    assert any(name.startswith("worker-") for name in collected), collected  # where the traceback is
    # A resume that trained nothing keeps the earlier run's report and writes its own beside it.
    assert json.load(open(os.path.join(out, "report.json")))["status"] == "ok"
    report = json.load(open(os.path.join(out, "report.failed.json")))
    assert report["status"] == "failed" and report["error"]
    shutil.rmtree(out, ignore_errors=True)  # kept only when the test fails, to read
