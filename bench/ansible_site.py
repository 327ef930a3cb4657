"""Wall time of `python -m alpa_job cluster up` (site.yml through ansible-runner) on 3 test-bed hosts over
real SSH: the cold run (nothing running -> cluster up, doctor green), the idempotent re-run (changed=0)
and `cluster down` (teardown.yml).

    python bench/ansible_site.py [--runtime docker|process] [--repeats N]
                                 (as root; builds and removes its own test bed)

docker (default, issue 11): the example inventory's defaults from a controller OUTSIDE the cluster
(tests/test_ansible_docker.py's setup: a site bed with a dockerd per node and a registry on the
controller); every cold run starts with the image absent on the nodes, so it includes the pull.
process: the controller inside the head, ray_runtime: process (tests/test_ansible.py's setup).
Each run's counts, duration and slowest tasks come from its summary.json (alpa_job/cluster/control/playbook.py).
Targets (issue 11): docker cold <= 120 s, re-run <= 40 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lib.checkout import REPO  # first: the test bed's package and alpa_job from this checkout
from kit_testbed.ansible_runs import Ansible
from kit_testbed.hosts import Testbed
from kit_testbed.sshd import SshBed
from lib.results import record
from lib.table import print_table

PREFIX = "aktbas"


def _docker_setup():
    from kit_testbed import site_layer
    from kit_testbed.ansible_runs import CONTAINER, SiteAnsible
    from kit_testbed.site_bed import SiteBed

    bed = Testbed.up(3, prefix=PREFIX, reuse=False, site=True, cgroups=True)
    ssh = SshBed(bed)
    site = site_layer.start_site(bed, registry_data=site_layer.IMAGE_CACHE / "registry")
    ssh.start()
    sb = SiteBed(bed, site, ssh)
    ans = SiteAnsible(sb)

    def reset():  # the cold run must pull: no container, no image on any node
        for node in sb.nodes:
            sb.docker(node, "rm", "-f", CONTAINER, check=False)
            sb.docker(node, "rmi", "-f", sb.image, check=False)

    return bed, ssh, ans, ans.inventory("bench"), reset


def _process_setup():
    bed = Testbed.up(3, prefix=PREFIX, reuse=False)
    ssh = SshBed(bed)
    ssh.start()
    ans = Ansible(ssh)
    return bed, ssh, ans, ans.good_inventory(), lambda: None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=["docker", "process"], default="docker")
    parser.add_argument("--repeats", type=int, default=1, help="cold/re-run/teardown cycles")
    opts = parser.parse_args()
    setup = _docker_setup if opts.runtime == "docker" else _process_setup
    bed = ssh = None
    rows, runs = [], []
    try:
        bed, ssh, ans, inventory, reset = setup()
        for i in range(opts.repeats):
            reset()
            cycle = {}
            for step, playbook in (("cold", "site.yml"), ("rerun", "site.yml"), ("teardown", "teardown.yml")):
                load = os.getloadavg()[0]
                p, summary = ans.run(playbook, inventory)
                if p.returncode != 0:
                    print(p.stdout[-5000:], p.stderr[-2000:], summary["failures"], file=sys.stderr)
                    raise SystemExit("%s failed (rc=%d)" % (playbook, p.returncode))
                cycle[step] = {
                    "seconds": summary["seconds"],
                    "changed": summary["changed_total"],
                    "recap": summary["hosts"],
                    "loadavg_1m_before": round(load, 2),
                    "slowest_tasks": summary["slowest"],
                }
            runs.append(cycle)
            rows.append(
                [
                    i,
                    cycle["cold"]["seconds"],
                    cycle["cold"]["changed"],
                    cycle["rerun"]["seconds"],
                    cycle["rerun"]["changed"],
                    cycle["teardown"]["seconds"],
                    cycle["cold"]["loadavg_1m_before"],
                    cycle["rerun"]["loadavg_1m_before"],
                ]
            )
        reset()
    finally:
        if ssh is not None:
            ssh.stop()
        if bed is not None:
            bed.down()
    table = print_table(["run", "site.yml cold s", "changed", "re-run s", "changed", "teardown s", "load cold", "load re-run"], rows)
    where = (
        "the example inventory's defaults (docker runtime, image pulled from the registry) from a controller outside the cluster"
        if opts.runtime == "docker"
        else "process runtime, controller in the head"
    )
    path = record(
        "ansible_site",
        {"hosts": 3, "runtime": opts.runtime, "runs": runs},
        table,
        "alpa_job cluster up (site.yml) on 3 test-bed hosts over SSH: %s" % where,
    )
    print("saved", os.path.relpath(path, REPO))
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    rc = main()
    print("total %.1f s" % (time.monotonic() - t0))
    sys.exit(rc)
