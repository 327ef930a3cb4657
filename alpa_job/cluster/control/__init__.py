"""Operate a cluster from the controller: `python -m alpa_job cluster up|down|status|logs|preflight`.

The rooms, one job each:

- inventory.py: the user's Ansible inventory, read by Ansible itself (`ansible-inventory --list` through
  ansible-runner), as nodes (SSH address, user, key, role) and the cluster plan its alpa_kit_* vars make;
- playbook.py: site.yml / teardown.yml through ansible-runner -> a `PlaybookSummary` (per-host counts,
  failures, duration), written as JSON in the run dir; playbook_view.py: live progress and the summary;
- remote.py: a node reached over SSH with fabric (or locally), every command bounded;
  docker_tunnel.py: that node's Docker API socket, forwarded over the same SSH connection, for the
  docker SDK;
- preflight.py (+ node_probe.py, what runs on the node): checks before any Ray exists;
- ray_http.py: Ray's state, log and jobs APIs on the head's dashboard port, every request bounded;
- status.py: the running cluster from Ray's state API vs the inventory;
- logs.py: every node's Ray logs, through Ray's log API while Ray is up, over SSH when it is not;
- cli.py: the `cluster` subcommand's arguments and dispatch.

These run on the controller (Python 3.11 venv with ansible-runner, fabric, docker: requirements/dev.txt);
logs.collect_job_logs also runs inside a job on the cluster, so logs.py keeps to the standard library,
requests (a Ray dependency) and ray at module level.
"""
