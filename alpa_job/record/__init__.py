"""The run record: what a run was and did, as one typed record with a JSON Schema.

Training (any engine) produces it; the readers in `alpa_job.inspect` render it. Modules, one job each:

- run_record.py: the typed record (`RunRecord` and its parts) and its schema, report.schema.json;
- plan.py: the engine-neutral parallel plan (per-leaf sharding, labels, meshes);
- hlo.py: collectives counted in compiled HLO text; traffic.py: each one's replica groups and the bytes
  it sends within a node and across nodes (the plan's and a run's network_traffic);
- alpa_dump.py: an Alpa `dump_debug_info` folder -> the plan; alpa_live.py: a live Alpa executable -> the plan;
- jax_program.py: a JAX program's arrays and shardings -> the plan, and XLA's memory analysis (jax imported
  inside its functions: the JAX engine's report and `inspect.plan_of` share it);
- report_file.py: the record assembled from the processes' results, written as and read from report.json.

Nothing here imports an engine (jax, flax, alpa) at import time: it runs on the Alpa image's Python 3.9 as on 3.11.
"""
