"""`doctor --network` on N test-bed hosts: the links both ways and the all-reduce, clean and with a token bucket
on one host's link; how long it takes, and whether it names that host and measures its links near the limit.

For each size (default 3 and 8): the bed and its firewalled Ray (`kit_testbed.ray_layer.start_ray`, as the tests'
`ray_cluster`), `python -m alpa_job doctor --network --format json` inside the head, then again with `tc qdisc
add dev eth0 root tbf rate RATE` on the last worker, then teardown. Prints a table and writes
bench/results/doctor_network-<time>.json.

    sudo .venv/bin/python bench/doctor_network.py [--sizes 3 8] [--rate-mbit 100]

Needs root, iproute2 (tc), util-linux, tini, nftables (like the test bed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import lib.checkout  # noqa: F401 - first: the test bed's package and alpa_job from this checkout
from kit_testbed import hosts, ray_layer
from lib import results


def one_size(n: int, rate_mbit: int, prefix: str) -> dict:
    hosts.down(prefix=prefix)
    bed = hosts.Testbed.up(n, prefix=prefix)
    try:
        ray_layer.start_ray(bed, num_cpus=1, object_store_memory=80_000_000, include_dashboard=False, timeout=300)
        clean = _doctor(bed)
        slow_host = bed.hosts[-1]
        bed.exec(
            slow_host.name,
            "tc",
            "qdisc",
            "add",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            "%dmbit" % rate_mbit,
            "burst",
            "64kb",
            "latency",
            "50ms",
        )
        try:
            limited = _doctor(bed)
        finally:
            bed.exec(slow_host.name, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
    finally:
        bed.down()
    return {"hosts": n, "rate_mbit": rate_mbit, "slow_host": slow_host.ip, "clean": clean, "limited": limited}


def _doctor(bed) -> dict:
    t0 = time.monotonic()
    report = ray_layer.doctor(bed, deadline=120, timeout=180, node_timeout=60, extra=["--network"])
    network = report.get("network") or {}
    links = network.get("links") or []
    failed = [c for c in report.get("checks", []) if not c["ok"]]
    return {
        "wall_s": round(time.monotonic() - t0, 1),
        "doctor_s": report.get("seconds"),
        "ok": report.get("ok"),
        "links": links,
        "median_gbps": network.get("median_gbps"),
        "min_gbps": network.get("min_gbps"),
        "all_reduce": network.get("all_reduce"),
        "failed": failed,
    }


def row(r: dict, which: str) -> list:
    d = r[which]
    out_of_slow = [x["gbps"] for x in d["links"] if x["src"] == r["slow_host"] and x["gbps"] is not None]
    named = [c["node"] for c in d["failed"] if c["name"] == "network" and c["node"]]
    reduce = d["all_reduce"] or {}
    return [
        str(r["hosts"]),
        which,
        "%.1f" % (d["doctor_s"] or float("nan")),
        str(len(d["links"])),
        "%.3g" % (d["median_gbps"] or 0),
        "%.3g" % (d["min_gbps"] or 0),
        "%.3g" % statistics.median(out_of_slow) if out_of_slow else "-",
        "%.3g" % (reduce.get("bus_gbps") or 0),
        ", ".join(sorted(set(named))) or "none",
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[3, 8])
    ap.add_argument("--rate-mbit", type=int, default=100)
    ap.add_argument("--prefix", default="akn")
    opts = ap.parse_args(argv)
    why = hosts.missing_requirements()
    if why:
        print("cannot run: " + "; ".join(why), file=sys.stderr)
        return 2
    rows = [one_size(n, opts.rate_mbit, opts.prefix) for n in opts.sizes]
    header = [
        "hosts",
        "run",
        "doctor s",
        "directions",
        "median Gb/s",
        "min Gb/s",
        "out of the slow host Gb/s",
        "all-reduce bus Gb/s",
        "named",
    ]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    lines += [" | ".join(row(r, which)) for r in rows for which in ("clean", "limited")]
    print("\n".join(lines))
    path = results.write_json(
        "doctor_network",
        {"command": results.command("python", argv, script=__file__), "rows": rows, "table": lines, "loadavg_1m": os.getloadavg()[0]},
    )
    print("saved", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
