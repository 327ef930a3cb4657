"""Wall time of `ansible-playbook site.yml` on 3 test-bed hosts over real SSH (ray_runtime: process):
the cold run (nothing running -> cluster up, doctor green), the idempotent re-run (changed=0) and
teardown.yml. The controller runs inside the head host, as in tests/test_ansible.py.

    python bench/ansible_site.py [--repeats N]     (as root; builds and removes its own test bed)
"""
from __future__ import annotations

import argparse
import os
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="cold/re-run/teardown cycles")
    opts = parser.parse_args()
    bed = Testbed.up(3, prefix=PREFIX, reuse=False)
    rows, runs = [], []
    try:
        sb = SshBed(bed)
        sb.start()
        ans = Ansible(sb)
        inventory = ans.good_inventory()
        for i in range(opts.repeats):
            cycle = {}
            for step, playbook in (("cold", "site.yml"), ("rerun", "site.yml"), ("teardown", "teardown.yml")):
                p, seconds = ans.run(playbook, inventory)
                counts = recap(p.stdout)
                if p.returncode != 0:
                    print(p.stdout[-5000:], p.stderr[-2000:], file=sys.stderr)
                    raise SystemExit("%s failed (rc=%d)" % (playbook, p.returncode))
                changed = sum(c["changed"] for c in counts.values())
                cycle[step] = {"seconds": round(seconds, 1), "changed": changed, "recap": counts}
            runs.append(cycle)
            rows.append([i, cycle["cold"]["seconds"], cycle["cold"]["changed"], cycle["rerun"]["seconds"],
                         cycle["rerun"]["changed"], cycle["teardown"]["seconds"]])
        sb.stop()
    finally:
        bed.down()
    table = print_table(["run", "site.yml cold s", "changed", "re-run s", "changed", "teardown s"], rows)
    path = record("ansible_site", {"hosts": 3, "runtime": "process", "runs": runs}, table,
                  "ansible-playbook site.yml on 3 test-bed hosts over SSH (process runtime)")
    print("saved", os.path.relpath(path, REPO))
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    rc = main()
    print("total %.1f s" % (time.monotonic() - t0))
    sys.exit(rc)
