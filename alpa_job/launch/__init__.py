"""Running a job: on this process, inside an Alpa session, or as one JAX process per node on Ray.

- runner.py: the job end to end (checks before Ray, the engine, where it trains, the report);
- connect.py: which Ray to join, bounded;
- controller.py: the job on Ray as a state machine (placing, running, recovering, finished, failed);
- worker_group.py: one JAX process per chosen node (place, start, launch, poll, kill);
  jax_process.py: that process, a Ray actor (joins jax.distributed, then runs the training loop);
- failure_policy.py: fail fast or restart (--max-restarts, --restart-wait) and the rules a restart keeps;
- failures.py: naming a lost process, and Ray's settled view of its node;
- recovery.py: the typed restart records and the final trajectory's counts;
- shared_out.py: the run directory every node must see.

What runs on or about nodes (spec, node IP, ray start, firewall, doctor) is `alpa_job.cluster`.
"""
