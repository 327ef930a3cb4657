"""Wall time of `ansible-playbook site.yml` on 3 test-bed hosts over real SSH: the cold run (nothing
running -> cluster up, doctor green), the idempotent re-run (changed=0) and teardown.yml.

    python bench/ansible_site.py [--runtime docker|process] [--repeats N] [--profile]
                                 (as root; builds and removes its own test bed)

docker (default, issue 11): the example inventory's defaults from a controller OUTSIDE the cluster
(tests/test_ansible_docker.py's setup: a site bed with a dockerd per node and a registry on the
controller); every cold run starts with the image absent on the nodes, so it includes the pull.
process: the controller inside the head, ray_runtime: process (tests/test_ansible.py's setup).
--profile: Ansible's profile_tasks callback; the slowest tasks of each run go into the raw JSON.
Targets (issue 11): docker cold <= 120 s, re-run <= 40 s.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO, os.path.join(REPO, "scripts"), os.path.join(REPO, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from common import print_table, record  # noqa: E402
from fixtures_ssh import SshBed  # noqa: E402
from test_ansible import Ansible, recap  # noqa: E402
from testbed_lib import Testbed  # noqa: E402

PREFIX = "aktbas"
# profile_tasks lines: "ray_cluster : Run the Ray container (...) ------- 12.34s"
_PROFILE = re.compile(r"^(.+?) -{2,} (\d+\.\d+)s$", re.M)


def slowest(stdout: str, n: int = 12):
    rows = [(name.strip(), float(s)) for name, s in _PROFILE.findall(stdout)]
    return sorted(rows, key=lambda r: -r[1])[:n]


def _docker_setup():
    import testbed_site
    from fixtures_testbed import SiteBed
    from test_ansible_docker import CONTAINER, SiteAnsible

    bed = Testbed.up(3, prefix=PREFIX, reuse=False, site=True, cgroups=True)
    ssh = SshBed(bed)
    site = testbed_site.start_site(bed, registry_data=testbed_site.IMAGE_CACHE / "registry")
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
    parser.add_argument("--profile", action="store_true", help="profile_tasks: the slowest tasks per run")
    opts = parser.parse_args()
    setup = _docker_setup if opts.runtime == "docker" else _process_setup
    if opts.profile:  # the commands inside the hosts inherit this environment
        os.environ["ANSIBLE_CALLBACKS_ENABLED"] = "ansible.posix.profile_tasks"
    bed = ssh = None
    rows, runs = [], []
    try:
        bed, ssh, ans, inventory, reset = setup()
        for i in range(opts.repeats):
            reset()
            cycle = {}
            for step, playbook in (("cold", "site.yml"), ("rerun", "site.yml"), ("teardown", "teardown.yml")):
                load = os.getloadavg()[0]
                p, seconds = ans.run(playbook, inventory)
                counts = recap(p.stdout)
                if p.returncode != 0:
                    print(p.stdout[-5000:], p.stderr[-2000:], file=sys.stderr)
                    raise SystemExit("%s failed (rc=%d)" % (playbook, p.returncode))
                changed = sum(c["changed"] for c in counts.values())
                cycle[step] = {"seconds": round(seconds, 1), "changed": changed, "recap": counts,
                               "loadavg_1m_before": round(load, 2), "slowest_tasks": slowest(p.stdout)}
            runs.append(cycle)
            rows.append([i, cycle["cold"]["seconds"], cycle["cold"]["changed"], cycle["rerun"]["seconds"],
                         cycle["rerun"]["changed"], cycle["teardown"]["seconds"], cycle["cold"]["loadavg_1m_before"],
                         cycle["rerun"]["loadavg_1m_before"]])
        reset()
    finally:
        if ssh is not None:
            ssh.stop()
        if bed is not None:
            bed.down()
    table = print_table(["run", "site.yml cold s", "changed", "re-run s", "changed", "teardown s", "load cold",
                         "load re-run"], rows)
    where = ("the example inventory's defaults (docker runtime, image pulled from the registry) from a controller "
             "outside the cluster" if opts.runtime == "docker" else "process runtime, controller in the head")
    path = record("ansible_site", {"hosts": 3, "runtime": opts.runtime, "runs": runs}, table,
                  "ansible-playbook site.yml on 3 test-bed hosts over SSH: %s" % where)
    print("saved", os.path.relpath(path, REPO))
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    rc = main()
    print("total %.1f s" % (time.monotonic() - t0))
    sys.exit(rc)
