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
all-pairs plan and its results), render.py (table / JSON / summary line), run.py (the driver), cli.py
(the CLI entry), nccl_log.py (`--nccl-log`: NCCL's own INFO log read into transports and verdicts,
with no cluster running). It imports on the Alpa image's stack too (Python 3.9, ray 2.1.0): only the
standard library at module level; ray and the spec's yaml are imported when the doctor runs.
"""
