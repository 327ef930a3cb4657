"""`python -m alpa_job doctor`: check a RUNNING cluster the way jobs will use it.

A green `ray status` proves nothing behind a firewall (a node whose node-manager port is blocked
joins, looks alive, and hangs every task pinned to it). So the doctor

1. connects with a timeout (an unreachable head fails in seconds, naming the address and the fix);
2. starts one small probe actor pinned to EACH alive node (ray_api.pin_to_node, num_cpus=0) with a
   per-node timeout: a node whose probe does not answer is a failure;
3. checks, per node, that Ray's IP is an address of that host AND lies in the spec's cluster_cidr;
   /dev/shm size; GPUs (nvidia-smi vs Ray's GPU resource); and that versions are equal everywhere;
4. probes TCP all-pairs: every node listens on its planned ports, every other node connects
   (matrix.py says why a listener must be there first); a blocked port is reported as source x target.

Every wait has a timeout, bounded by `--deadline`; on the deadline the doctor reports what it knows
and fails. Exit 0 when every check passes, 3 (EXIT_CHECK_FAILED) otherwise.

The rooms: probe.py (what runs on every node), checks.py (verdicts on a node's facts), matrix.py (the
all-pairs plan and its results), render.py (table / JSON / summary line), run.py (the driver); this
module is the CLI entry. It imports on the Alpa image's stack too (Python 3.9, ray 2.1.0): only the
standard library at module level; ray and the spec's yaml are imported when the doctor runs.
"""
from __future__ import annotations

import os
import sys

from alpa_job.cluster.doctor.checks import (  # noqa: F401  (the doctor's public names)
    VERSION_KEYS, check, check_gpus, check_node_ip, check_shm, compare_versions)
from alpa_job.cluster.doctor.probe import NodeProbe, node_facts  # noqa: F401
from alpa_job.cluster.doctor.render import failure_summary, render_json, render_table
from alpa_job.cluster.doctor.run import DEFAULT_DEADLINE_S, NODE_TIMEOUT_S, run_doctor
from alpa_job.errors import EXIT_CHECK_FAILED, EXIT_OK


def main(args) -> int:
    """CLI entry (alpa_job.cli dispatches here): exit 0 all ok, 3 on a failed check."""
    from alpa_job.cluster.spec import load_spec

    spec = load_spec(getattr(args, "cluster_spec", None))  # resolved once, passed down
    address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS") or "auto"
    deadline = float(getattr(args, "deadline", None) or DEFAULT_DEADLINE_S)
    node_timeout = float(getattr(args, "node_timeout", None) or NODE_TIMEOUT_S)
    skip = [n.strip() for n in (getattr(args, "skip_ports", None) or "").split(",") if n.strip()]
    result = run_doctor(address, spec, deadline_s=deadline, node_timeout_s=node_timeout, skip_ports=skip)
    print(render_json(result) if getattr(args, "format", "table") == "json" else render_table(result))
    if not result["ok"]:
        print(failure_summary(result), file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK
