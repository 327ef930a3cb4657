"""Seconds from nothing to N test-bed hosts with a firewalled Ray cluster joined and `doctor` green.

For each size (default 3 and 8): bring the test bed up (namespaces, bridge, tini), then the ONE Ray
bring-up `kit_testbed.ray_layer.start_ray` (the same code as `scripts/testbed up --ray` and the tests'
`ray_cluster` fixture): the spec's nftables rules + sysctls in every host, `ray start` on the head
(dashboard on: `ray job submit` needs it) and on every worker in parallel as soon as the head's GCS
listens, `alpa_job.cluster.wait_nodes` until N nodes are alive; then `python -m alpa_job doctor
--format json` inside the head until it is green; tear down (`ray stop` everywhere, then the hosts).
Records the 1-minute load average before and after each size (the machine may be shared). Prints a
table, writes bench/results/testbed_bringup-<time>.json and appends a section to bench/RESULTS.md
with the exact command.

    sudo .venv/bin/python bench/testbed_bringup.py [--sizes 3 8] [--num-cpus 1] [--object-store-memory 80000000]

Needs root, iproute2, util-linux, tini, nftables (like the test bed).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import lib.checkout  # noqa: F401 - first: the test bed's package and alpa_job from this checkout
from kit_testbed import hosts, ray_layer
from lib import results


def bring_up(n: int, num_cpus: int, store: int, prefix: str, timeout: float, max_parallel=None) -> dict:
    t = {}
    load_before = os.getloadavg()[0]
    hosts.down(prefix=prefix)
    t0 = time.monotonic()
    bed = hosts.Testbed.up(n, prefix=prefix)
    result = {"hosts": n}
    try:
        t["bed_up"] = time.monotonic() - t0
        info = ray_layer.start_ray(
            bed, num_cpus=num_cpus, object_store_memory=store, include_dashboard=True, timeout=timeout, max_parallel=max_parallel
        )
        steps = info["seconds"]
        t["firewall"] = steps["firewall"]
        t["head_gcs"] = steps["head_gcs"]
        t["ray_start"] = steps["ray_start"]
        t["wait"] = steps["wait"]
        t["joined_total"] = time.monotonic() - t0
        mark = time.monotonic()
        doctor = None
        attempts = 0
        while time.monotonic() - mark < timeout:
            attempts += 1
            doctor = ray_layer.doctor(bed, deadline=120, timeout=180, node_timeout=60)
            if doctor.get("ok"):
                break
        t["doctor"] = time.monotonic() - mark
        t["green_total"] = time.monotonic() - t0
        failed = [c for c in doctor.get("checks", []) if not c["ok"]] if doctor else []
        result.update(
            {
                "alive": len(info["nodes"]),
                "late_workers": info.get("late_workers", []),
                "worker_retries": info.get("worker_retries", []),
                "doctor_ok": bool(doctor and doctor.get("ok")),
                "doctor_attempts": attempts,
                "doctor_own_seconds": doctor.get("seconds") if doctor else None,
                "doctor_failed": failed[:5],
            }
        )
    finally:
        mark = time.monotonic()
        bed.down()
        t["teardown"] = time.monotonic() - mark
    result["seconds"] = {k: round(v, 2) for k, v in t.items()}
    result["loadavg_1m"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[3, 8])
    ap.add_argument("--num-cpus", type=int, default=1)
    ap.add_argument("--object-store-memory", type=int, default=80_000_000)
    ap.add_argument("--prefix", default="akb")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--max-parallel", type=int, default=None, help="workers starting at once (default: ray_layer's, cores + 1)")
    ap.add_argument("--no-record", action="store_true", help="do not write bench/results or bench/RESULTS.md")
    opts = ap.parse_args(argv)
    why = hosts.missing_requirements()
    if why:
        print("cannot run: " + "; ".join(why), file=sys.stderr)
        return 2
    rows = [bring_up(n, opts.num_cpus, opts.object_store_memory, opts.prefix, opts.timeout, opts.max_parallel) for n in opts.sizes]
    cols = ("bed_up", "firewall", "head_gcs", "ray_start", "wait", "joined_total", "doctor", "green_total", "teardown")
    header = ["hosts", "alive", "doctor"] + list(cols) + ["late / restarted workers", "load 1m before/after"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in rows:
        lines.append(
            " | ".join(
                [str(r["hosts"]), str(r.get("alive")), "green" if r.get("doctor_ok") else "RED"]
                + ["%.1f" % r["seconds"].get(c, float("nan")) for c in cols]
                + ["%d / %d" % (len(r.get("late_workers", [])), len(r.get("worker_retries", [])))]
                + ["%.2f / %.2f" % (r["loadavg_1m"]["before"], r["loadavg_1m"]["after"])]
            )
        )
    table = "\n".join("| %s |" % line for line in lines)
    print(table)
    command = results.command("python", argv, script=__file__)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")  # local time: this script's files always were
    result = {
        "command": command,
        "when": stamp,
        "machine": results.machine("cpus", "python", "kernel"),
        "num_cpus": opts.num_cpus,
        "object_store_memory": opts.object_store_memory,
        "runs": rows,
    }
    if not opts.no_record:
        out = results.write_json("testbed_bringup", result, stamp=stamp)
        results.append_to_results_md(
            "\n## Test bed bring-up: nothing -> N hosts joined -> doctor green (%s)\n\n"
            % stamp
            + "`%s` (as root; %d CPUs, Python %s; each node `--num-cpus %d --object-store-memory %d`, "
            "dashboard on the head only; spec firewall loaded in every host). Seconds; "
            "`joined_total` = bed up + firewall + `ray start` everywhere (workers once the head's GCS "
            "listens) + wait_nodes, `green_total` = that + doctor until green; load = 1-minute load "
            "average before/after (shared machine). Raw: `bench/results/%s`.\n\n"
            % (command, os.cpu_count() or 0, platform.python_version(), opts.num_cpus, opts.object_store_memory, os.path.basename(out))
            + table
            + "\n"
        )
        print("saved bench/results/%s; appended to bench/RESULTS.md" % os.path.basename(out))
    return 0 if all(r["doctor_ok"] for r in rows) else 3


if __name__ == "__main__":
    sys.exit(main())
