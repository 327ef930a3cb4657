"""`python -m alpa_job doctor`: the doctor's CLI entry (the checks themselves: run.py)."""
from __future__ import annotations

import os
import sys

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
    result = run_doctor(address, spec, deadline_s=deadline, node_timeout_s=node_timeout, skip_ports=skip,
                        network=bool(getattr(args, "network", False)))
    print(render_json(result) if getattr(args, "format", "table") == "json" else render_table(result))
    if not result["ok"]:
        print(failure_summary(result), file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK
