"""Seconds from nothing to N test-bed hosts with a firewalled Ray cluster joined and `doctor` green.

For each size (default 3 and 6): bring the test bed up (namespaces, bridge, tini), load the spec's
nftables rules and sysctl in every host, `ray start` the head (dashboard on: `ray job submit`
needs it) then every worker in parallel (ports pinned by alpa_job.cluster.ray_start), wait until N
nodes are alive, run `python -m alpa_job doctor --format json` inside the head until it is green,
tear down. Prints a table, writes bench/results/testbed_bringup-<time>.json and appends a section
to bench/RESULTS.md with the exact command.

    sudo .venv/bin/python bench/testbed_bringup.py [--sizes 3 6] [--num-cpus 1] [--object-store-memory 80000000]

Needs root, iproute2, util-linux, tini, nftables (like the test bed).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import testbed_lib  # noqa: E402

from alpa_job.cluster.firewall import render_nftables  # noqa: E402
from alpa_job.cluster.ray_start import ray_start_args  # noqa: E402
from alpa_job.cluster.spec import load_spec  # noqa: E402

def _exec(bed, host, *cmd, timeout=120, env=None):
    p = bed.exec(host, *cmd, timeout=timeout, env=env, check=False)
    if p.returncode != 0:
        raise RuntimeError("[%s] %s failed (rc=%d):\n%s\n%s" % (host, shlex.join(map(str, cmd))[:200], p.returncode,
                                                              p.stdout[-2000:], p.stderr[-2000:]))
    return p


def _start_worker(bed, host, argv, timeout):
    """`ray start` on a worker; on an overloaded machine Ray's own start-up timeout can fire: one retry."""
    try:
        return _exec(bed, host, *argv, timeout=timeout)
    except RuntimeError as err:
        print("retrying %s after: %s" % (host, str(err).strip().splitlines()[-1][:200]), file=sys.stderr)
        bed.exec(host, "ray", "stop", "--force", timeout=60, check=False)
        return _exec(bed, host, *argv, timeout=timeout)


def bring_up(n: int, num_cpus: int, store: int, prefix: str, timeout: float) -> dict:
    t = {}
    t0 = time.monotonic()
    testbed_lib.down(prefix=prefix)
    bed = testbed_lib.Testbed.up(n, prefix=prefix)
    try:
        t["bed_up"] = time.monotonic() - t0
        spec_path = bed.state_dir / "cluster-spec.yaml"
        spec_path.write_text("cluster_cidr: %s\n" % bed.subnet)
        spec = load_spec(str(spec_path))
        members = list(bed.ips.values())
        for i, h in enumerate(bed.hosts):
            fw = bed.state_dir / ("nftables-%s.nft" % h.name)
            fw.write_text(render_nftables(spec, h.ip, members, "head" if i == 0 else "worker"))
            bed.exec(h.name, "nft", "-f", str(fw), timeout=30)
            for key, value in spec.sysctl().items():
                bed.exec(h.name, "sysctl", "-q", "-w", "%s=%s" % (key, value), timeout=30)
        t["firewall"] = time.monotonic() - t0 - t["bed_up"]
        mark = time.monotonic()
        _exec(bed, "head", *ray_start_args(spec, "head", bed.head.ip, num_cpus=num_cpus, object_store_memory=store,
                                         include_dashboard=True), timeout=timeout)
        t["head_start"] = time.monotonic() - mark
        mark = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max(1, n - 1)) as ex:
            futs = [ex.submit(_start_worker, bed, h.name, ray_start_args(spec, "worker", h.ip, head_ip=bed.head.ip,
                                                                         num_cpus=num_cpus, object_store_memory=store),
                              timeout) for h in bed.hosts[1:]]
            for f in futs:
                f.result()
        address = "%s:%d" % (bed.head.ip, spec.ports["gcs"])
        p = bed.exec("head", "python", "-m", "alpa_job.cluster.wait_nodes", "--count", str(n), "--timeout",
                     str(timeout), env={"RAY_ADDRESS": address}, check=False,
                     timeout=timeout + 60)
        alive = len(json.loads([x for x in p.stdout.splitlines() if x.startswith("{")][-1])["alive"])
        t["workers_joined"] = time.monotonic() - mark
        t["joined_total"] = time.monotonic() - t0
        mark = time.monotonic()
        doctor = None
        attempts = 0
        while time.monotonic() - mark < timeout:
            attempts += 1
            d = bed.exec("head", "python", "-m", "alpa_job", "doctor", "--address", address, "--cluster-spec",
                         str(spec_path), "--format", "json", "--deadline", "120", "--node-timeout", "60",
                         timeout=180, check=False)
            try:
                doctor = json.loads(d.stdout)
            except ValueError:
                doctor = {"ok": False, "error": d.stderr[-500:]}
            if doctor.get("ok"):
                break
        t["doctor"] = time.monotonic() - mark
        t["green_total"] = time.monotonic() - t0
        failed = [c for c in doctor.get("checks", []) if not c["ok"]] if doctor else []
        result = {"hosts": n, "alive": alive, "doctor_ok": bool(doctor and doctor.get("ok")),
                "doctor_attempts": attempts, "doctor_own_seconds": doctor.get("seconds") if doctor else None,
                "doctor_failed": failed[:5]}
    finally:
        mark = time.monotonic()
        bed.down()
        t["teardown"] = time.monotonic() - mark
    result["seconds"] = {k: round(v, 2) for k, v in t.items()}
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[3, 6])
    ap.add_argument("--num-cpus", type=int, default=1)
    ap.add_argument("--object-store-memory", type=int, default=80_000_000)
    ap.add_argument("--prefix", default="akb")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--no-record", action="store_true", help="do not write bench/results or bench/RESULTS.md")
    opts = ap.parse_args(argv)
    why = testbed_lib.missing_requirements()
    if why:
        print("cannot run: " + "; ".join(why), file=sys.stderr)
        return 2
    rows = [bring_up(n, opts.num_cpus, opts.object_store_memory, opts.prefix, opts.timeout) for n in opts.sizes]
    cols = ("bed_up", "firewall", "head_start", "workers_joined", "joined_total", "doctor", "green_total", "teardown")
    header = ["hosts", "alive", "doctor"] + list(cols)
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in rows:
        lines.append(" | ".join([str(r["hosts"]), str(r["alive"]), "green" if r["doctor_ok"] else "RED"]
                                + ["%.1f" % r["seconds"].get(c, float("nan")) for c in cols]))
    table = "\n".join("| %s |" % line for line in lines)
    print(table)
    command = "python bench/testbed_bringup.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = {"command": command.strip(), "when": stamp, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
              "kernel": platform.release()}, "num_cpus": opts.num_cpus, "object_store_memory": opts.object_store_memory,
              "runs": rows}
    if not opts.no_record:
        out = REPO / "bench" / "results" / ("testbed_bringup-%s.json" % stamp)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        with open(REPO / "bench" / "RESULTS.md", "a") as f:
            f.write("\n## Test bed bring-up: nothing -> N hosts joined -> doctor green (%s)\n\n" % stamp)
            f.write("`%s` (as root; %d CPUs, Python %s; each node `--num-cpus %d --object-store-memory %d`, "
                    "dashboard on the head only; spec firewall loaded in every host). Seconds; "
                    "`joined_total` = bed up + firewall + head + workers alive, `green_total` = that + doctor "
                    "until green. Raw: `bench/results/%s`.\n\n"
                    % (command.strip(), os.cpu_count() or 0, platform.python_version(), opts.num_cpus,
                       opts.object_store_memory, out.name))
            f.write(table + "\n")
        print("saved %s; appended to bench/RESULTS.md" % out.relative_to(REPO))
    return 0 if all(r["doctor_ok"] for r in rows) else 3


if __name__ == "__main__":
    sys.exit(main())
