"""`python -m alpa_job cluster up|down|status|logs|preflight`: the arguments, and one function per action.

alpa_job/cli.py hands `cluster` here (add_parser, main); the work is in the sibling modules.
Exit codes: 0 ok, 2 a mistake to fix (bad inventory, ...), 3 a failed play / check / a cluster that
differs from the inventory, 4 a network wait that ran out.
"""

from __future__ import annotations

import os
import sys

from alpa_job.errors import EXIT_CHECK_FAILED, EXIT_OK

ACTIONS = ("up", "down", "status", "logs", "preflight")


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="operate the cluster from this controller: up, down, status, logs, preflight")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True

    def inventory(q):
        q.add_argument("--inventory", "-i", help="Ansible inventory (default: ansible/inventory/hosts.yml)")

    for name, what in (
        ("up", "run ansible/site.yml: checks, node prep, firewall, Ray head and workers, doctor"),
        ("down", "run ansible/teardown.yml: stop Ray and remove the kit's firewall table"),
    ):
        q = actions.add_parser(name, help=what)
        inventory(q)
        q.add_argument("--check", action="store_true", help="Ansible's --check: show what would change, change nothing")
        q.add_argument("--run-dir", help="where ansible-runner's artifacts and summary.json go (default runs/cluster-<playbook>-<time>)")
        q.add_argument("--timeout", type=float, default=1800, help="stop the play after this many seconds")
        q.add_argument(
            "--extra-vars", "-e", action="append", default=[], metavar="KEY=VALUE", help="passed to ansible-playbook -e (repeatable)"
        )
    q = actions.add_parser("status", help="the running cluster (Ray's state API) against the inventory; exit 3 if they differ")
    inventory(q)
    q.add_argument(
        "--address",
        help="the head's dashboard/jobs URL or host (default: the inventory's head; without an inventory: Ray's view only, not compared)",
    )
    q.add_argument("--timeout", type=float, default=10.0, help="seconds per request to the head")
    q.add_argument("--format", default="table", choices=("table", "json"))
    q = actions.add_parser("logs", help="collect every node's Ray logs into DIR/<host>/ (Ray's log API, else SSH)")
    inventory(q)
    q.add_argument("--job", help="only this job's worker/driver logs (submission id or Ray job id) + node-wide logs")
    q.add_argument("--out", help="folder (default runs/cluster-logs-<time>)")
    q.add_argument(
        "--address",
        help="the head's dashboard URL or host (default: the inventory's head; without an inventory, Ray's node list names the hosts)",
    )
    q.add_argument("--ssh-only", action="store_true", help="skip Ray's log API: copy every node's log dir over SSH")
    q.add_argument("--tail", type=int, default=-1, help="log API: only the last N lines of each file")
    q.add_argument("--deadline", type=float, default=300.0, help="overall seconds before giving up")
    q = actions.add_parser(
        "preflight", help="check every node over SSH before Ray: CIDR interface, ports, Docker, image, GPUs, /dev/shm, clocks"
    )
    inventory(q)
    q.add_argument("--deadline", type=float, default=25.0, help="overall seconds before giving up")
    q.add_argument("--connect-timeout", type=float, default=5.0, help="seconds for one SSH connection")
    q.add_argument("--format", default="table", choices=("table", "json"))


def main(args) -> int:
    from alpa_job.cluster.control.inventory import load_inventory

    if args.action in ("up", "down"):
        return _playbook(args)
    inv = _inventory_unless_ray(args) if args.action in ("status", "logs") else load_inventory(args.inventory)
    if args.action == "status":
        from alpa_job.cluster.control import status

        return _verdict(status, status.cluster_status(inv, address=args.address, timeout_s=args.timeout), args)
    if args.action == "logs":
        import time

        from alpa_job.cluster.control import logs

        out = args.out or os.path.join("runs", "cluster-logs-%s" % time.strftime("%Y%m%d-%H%M%S"))
        summary = logs.collect_logs(
            inv, out, job=args.job, address=args.address, deadline_s=args.deadline, lines=args.tail, use_api=not args.ssh_only
        )
        print(logs.render_table(summary))
        if not summary["ok"]:
            bad = [h["host"] for h in summary["hosts"] if not (h["files"] and h["how"] in ("api", "ssh"))]
            print(
                "cluster logs: nothing collected from %s; see %s" % (", ".join(bad), os.path.join(summary["out"], logs.COLLECTION_FILE)),
                file=sys.stderr,
            )
            return EXIT_CHECK_FAILED
        return EXIT_OK
    from alpa_job.cluster.control import preflight

    return _verdict(preflight, preflight.run_preflight(inv, deadline_s=args.deadline, connect_timeout_s=args.connect_timeout), args)


def _inventory_unless_ray(args):
    """status / logs: the inventory when one is given or at the default path; else None, and Ray's own node
    list names the hosts (the commands then ask Ray at --address, or $RAY_ADDRESS, and say so if it is silent)."""
    from alpa_job.errors import KitError
    from alpa_job.cluster.control.inventory import DEFAULT_INVENTORY, load_inventory

    if args.inventory or os.path.exists(DEFAULT_INVENTORY):
        return load_inventory(args.inventory)
    if getattr(args, "ssh_only", False):
        raise KitError(
            "cluster logs --ssh-only reaches the nodes over SSH, which needs the inventory (none at %s); "
            "pass --inventory FILE, or leave out --ssh-only to collect through Ray's log API" % DEFAULT_INVENTORY
        )
    args.address = args.address or os.environ.get("RAY_ADDRESS") or None
    if not args.address or args.address in ("auto", "local"):
        raise KitError(
            "cluster %s: no inventory at %s and no --address; with Ray up, pass --address HEAD (the head's "
            "IP, HEAD:GCS_PORT or its dashboard URL); else pass --inventory FILE" % (args.action, DEFAULT_INVENTORY)
        )
    return None


def _verdict(check, result, args) -> int:
    """Print a check's result (`check`: the status or preflight module) and turn it into the exit code."""
    print(check.render_json(result) if args.format == "json" else check.render_table(result))
    if not result["ok"]:
        print(check.failure_summary(result), file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def _playbook(args) -> int:
    from alpa_job.errors import KitError
    from alpa_job.cluster.control.inventory import DEFAULT_INVENTORY
    from alpa_job.cluster.control.playbook import PLAYBOOKS, run_playbook
    from alpa_job.cluster.control.playbook_view import Progress, render_summary

    inventory = os.path.abspath(args.inventory or DEFAULT_INVENTORY)
    if not os.path.exists(inventory):
        raise KitError("inventory %s not found; copy ansible/inventory/example.yml there or pass --inventory FILE" % inventory)
    extravars = {}
    for item in args.extra_vars:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise KitError("--extra-vars %r is not KEY=VALUE" % item)
        extravars[key] = value
    playbook = PLAYBOOKS[args.action]
    with Progress("%s%s" % (playbook, " --check" if args.check else "")) as progress:
        summary = run_playbook(
            playbook, inventory, check=args.check, run_dir=args.run_dir, extravars=extravars, on_event=progress, timeout_s=args.timeout
        )
    print(render_summary(summary))
    if not summary.ok:
        first = ([f for f in summary.failures if not f.get("ignored")] or [{"host": "", "task": "", "message": summary.status}])[0]
        print(
            "cluster %s: %s failed%s: %s"
            % (args.action, playbook, " on %s (%s)" % (first["host"], first["task"]) if first["host"] else "", first["message"][:300]),
            file=sys.stderr,
        )
        return EXIT_CHECK_FAILED
    return EXIT_OK
