"""Seconds from a worker host's death to the first training step after recovery (issue 12).

A 3-host test bed with the one Ray bring-up (kit_testbed.ray_layer.start_ray), then for each run:
`python -m alpa_job train --max-restarts 1` from the head (3 JAX processes x 2 CPU devices, MLP,
--checkpoint-every EVERY, --out on the machine's /tmp: one folder every test-bed host sees); once the
checkpoint of step KILL_AT is complete, the host w2 is killed (SIGKILL to its PID 1: raylet, object
store and JAX process die at once). From the run's report (`restarts[0]`):

  detect_s     kill -> the driver named the lost process (restarts[0].time)
  recover_s    detection -> the first step of the restarted attempt (restarts[0].recover_seconds):
               Ray's view settling (its health checks mark the node dead), 2 new processes, their
               compile, the orbax restore onto the 4-device mesh
  total_s      kill -> first step after recovery
  steps_lost   steps run past the restored checkpoint (<= EVERY)

Also (`--fail-fast`): the same kill with --max-restarts 0, kill -> the driver's exit. The bed is
brought up again between runs (a killed host does not come back). Records the 1-minute load average
(the machine may be shared), writes bench/results/node_loss-<time>.json, appends to bench/RESULTS.md.

    sudo .venv/bin/python bench/node_loss.py [--runs 1] [--fail-fast] [--prefix aktb]

Needs root, iproute2, util-linux, tini, nftables (like the test bed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import lib.checkout  # noqa: F401 - first: the test bed's package and alpa_job from this checkout
from kit_testbed import hosts, ray_layer
from lib.results import record
from lib.table import print_table

from alpa_job.train.checkpoint_files import latest_complete_step

EVERY = 10
KILL_AT = 20
STEPS = 80
BATCH = 96


def _iso(text: str) -> float:
    return datetime.datetime.fromisoformat(text).timestamp()


def one_run(prefix: str, max_restarts: int, timeout: float) -> dict:
    hosts.down(prefix=prefix)
    bed = hosts.Testbed.up(3, prefix=prefix)
    out = Path("/tmp") / ("%s-node-loss-%s" % (prefix, uuid.uuid4().hex[:8]))
    out.mkdir()
    try:
        info = ray_layer.start_ray(bed, num_cpus=2, object_store_memory=200_000_000, include_dashboard=True, timeout=120)
        spec_path = info["spec_path"]
        address = info.get("address") or "%s:6379" % bed.head.ip
        load_before = os.getloadavg()[0]
        argv = [
            "python",
            "-m",
            "alpa_job",
            "train",
            "--model",
            "mlp",
            "--hidden-dim",
            "512",
            "--steps",
            str(STEPS),
            "--devices",
            "2",
            "--batch-size",
            str(BATCH),
            "--checkpoint-every",
            str(EVERY),
            "--max-restarts",
            str(max_restarts),
            "--address",
            address,
            "--cluster-spec",
            str(spec_path),
            "--out",
            str(out),
        ]
        log_path = out.parent / (out.name + ".log")
        with open(log_path, "w") as log:
            p = bed.popen("head", *argv, stdout=log, stderr=subprocess.STDOUT, env={"RAY_ADDRESS": address})
            deadline = time.monotonic() + timeout
            killed = None
            while p.poll() is None and time.monotonic() < deadline:
                if killed is None and (latest_complete_step(str(out / "checkpoints")) or 0) >= KILL_AT:
                    killed = time.time()
                    os.kill(bed.host("w2").pid, signal.SIGKILL)
                time.sleep(0.05)
            if p.poll() is None:
                p.kill()
            ended = time.time()
        row = {
            "max_restarts": max_restarts,
            "rc": p.returncode,
            "killed": killed is not None,
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
        }
        if killed is None:
            row["error"] = "the job ended before checkpoint %d" % KILL_AT
            return row
        if max_restarts == 0:
            row["exit_s"] = round(ended - killed, 2)
            row["named_host"] = "on host w2" in log_path.read_text()
            return row
        report = json.loads((out / "report.json").read_text())
        r = report["restarts"][0]
        detected = _iso(r["time"])
        row.update(
            detect_s=round(detected - killed, 2),
            recover_s=r["recover_seconds"],
            total_s=round(detected - killed + (r["recover_seconds"] or 0), 2),
            steps_lost=r["steps_lost"],
            resumed_from=r["resumed_from_step"],
            steps=report["steps"],
            host=r["host"],
        )
        return row
    finally:
        bed.down(graceful=False)
        subprocess.run(["rm", "-rf", str(out)], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--fail-fast", action="store_true", help="also time --max-restarts 0 (kill -> exit)")
    ap.add_argument("--prefix", default="aktb")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    rows = []
    for _ in range(args.runs):
        rows.append(one_run(args.prefix, 1, args.timeout))
        if args.fail_fast:
            rows.append(one_run(args.prefix, 0, args.timeout))
    header = ["max_restarts", "rc", "detect_s", "recover_s", "total_s", "steps_lost", "exit_s", "load before/after"]
    table = print_table(
        header,
        [
            [
                r.get("max_restarts"),
                r.get("rc"),
                r.get("detect_s", "-"),
                r.get("recover_s", "-"),
                r.get("total_s", "-"),
                r.get("steps_lost", "-"),
                r.get("exit_s", "-"),
                "%s / %s" % (r.get("load_before"), r.get("load_after")),
            ]
            for r in rows
        ],
    )
    record(
        "node_loss",
        {"rows": rows, "every": EVERY, "kill_at": KILL_AT, "steps": STEPS},
        table,
        "Node loss on 3 test-bed hosts: kill w2's PID 1 after checkpoint %d (every %d), seconds to the first "
        "step after recovery (--max-restarts 1) and to the exit (--max-restarts 0)" % (KILL_AT, EVERY),
    )


if __name__ == "__main__":
    main()
