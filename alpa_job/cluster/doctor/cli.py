"""`python -m alpa_job doctor`: the doctor's CLI entry (the checks themselves: run.py)."""

from __future__ import annotations

import os
import sys

from alpa_job.cluster.doctor.render import failure_summary, render_json, render_table
from alpa_job.cluster.doctor.run import DEFAULT_DEADLINE_S, NODE_TIMEOUT_S, run_doctor
from alpa_job.errors import EXIT_CHECK_FAILED, EXIT_OK, KitError


def main(args) -> int:
    """CLI entry (alpa_job.cli dispatches here): exit 0 all ok, 3 on a failed check."""
    from alpa_job.cluster.spec import load_spec

    if getattr(args, "nccl_log", None):
        return nccl_main(args)
    spec = load_spec(getattr(args, "cluster_spec", None))  # resolved once, passed down
    address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS") or "auto"
    deadline = float(getattr(args, "deadline", None) or DEFAULT_DEADLINE_S)
    node_timeout = float(getattr(args, "node_timeout", None) or NODE_TIMEOUT_S)
    skip = [n.strip() for n in (getattr(args, "skip_ports", None) or "").split(",") if n.strip()]
    result = run_doctor(
        address, spec, deadline_s=deadline, node_timeout_s=node_timeout, skip_ports=skip, network=bool(getattr(args, "network", False))
    )
    print(render_json(result) if getattr(args, "format", "table") == "json" else render_table(result))
    if not result["ok"]:
        print(failure_summary(result), file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def nccl_main(args) -> int:
    """`doctor --nccl-log FILE...`: NCCL's transports in one line, then one FAIL line per problem.
    Exit 0 when NCCL did what the fabric asks, 3 on a problem, 2 when the files hold no NCCL lines."""
    from alpa_job.cluster.doctor import nccl_log
    from alpa_job.cluster.spec import load_spec

    fabric = args.fabric or load_spec(getattr(args, "cluster_spec", None)).network.fabric
    summary = nccl_log.read_logs(args.nccl_log)
    if not summary.lines:
        raise KitError("no NCCL INFO lines in %s; %s and give its log" % (", ".join(args.nccl_log), nccl_log.NCCL_DEBUG_HINT))
    found = nccl_log.verdicts(summary, fabric)
    line = nccl_log.transports_line(summary)
    if getattr(args, "format", "table") == "json":
        print(render_json({"ok": not found, "fabric": fabric, "transports": line, "verdicts": found, "summary": summary.to_dict()}))
    else:
        print("\n".join([line] + (["FAIL " + v for v in found] or ["ok   NCCL's transports fit fabric %s" % fabric])))
    return EXIT_CHECK_FAILED if found else EXIT_OK
