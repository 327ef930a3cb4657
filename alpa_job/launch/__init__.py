"""Running a job: on this process, inside an Alpa session, or as one JAX process per node on Ray.

- runner.py: the job end to end (checks before Ray, the engine, where it trains, the report);
- connect.py: which Ray to join, bounded;
- processes.py: the worker group on Ray and its supervision; failures.py: why a process was lost;
- restarts.py: the restart policy's pure rules; shared_out.py: the run directory every node must see.

What runs on or about nodes (spec, node IP, ray start, firewall, doctor) is `alpa_job.cluster`.
"""
