"""Wait until N Ray nodes are alive, with a deadline.

`ray start` returning proves nothing about the cluster: a worker may still be joining (or never
join: https://github.com/alpa-projects/alpa/issues/722). Bring-up (test bed, benches, Ansible users) waits with this instead of sleeping:

    python -m alpa_job.cluster.wait_nodes --count 3 [--timeout 90] [--address HEAD:6379]

prints JSON {"alive": [ips], "resources": {ip: {...}}} and exits 0 once `count` nodes are alive,
4 (EXIT_TIMEOUT) when the deadline passes first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

from alpa_job.cluster import ray_api
from alpa_job.errors import EXIT_OK, EXIT_TIMEOUT, KitError


def wait_for_alive(count: int, timeout_s: float, poll_s: float = 0.3) -> List[ray_api.RayNode]:
    """Poll the connected cluster until `count` nodes are alive or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = ray_api.alive_nodes()
        if len(nodes) >= count or time.monotonic() >= deadline:
            return nodes
        time.sleep(poll_s)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m alpa_job.cluster.wait_nodes", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, required=True, help="nodes that must be alive")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds before giving up (joining included)")
    parser.add_argument("--address", default=None, help="Ray GCS address (default: RAY_ADDRESS, else auto)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        ray_api.join_ray(ray_api.normalize_address(args.address), args.timeout, log_to_driver=False)
    except KitError as err:
        print("error: %s" % err, file=sys.stderr)
        return err.exit_code
    nodes = wait_for_alive(args.count, max(0.0, args.timeout - (time.monotonic() - start)))
    print(json.dumps({"alive": [n.ip for n in nodes], "resources": {n.ip: dict(n.resources) for n in nodes}}))
    if len(nodes) < args.count:
        print(
            f"error: only {len(nodes)} of {args.count} Ray nodes alive after {args.timeout:.0f} s; run "
            "python -m alpa_job doctor and read the missing nodes' /tmp/ray/session_latest/logs/raylet.out",
            file=sys.stderr,
        )
        return EXIT_TIMEOUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
