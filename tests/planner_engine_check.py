"""Run in a subprocess with 8 CPU devices: for each strategy, a real JaxEngine (state initialised on the
devices, step compiled) beside the planner's compile of the same candidate; prints JSON to compare."""

import json
import os
import sys

from alpa_job.cpu_devices import with_device_count

os.environ["XLA_FLAGS"] = with_device_count(8)  # the caller's other flags stay
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

from alpa_job.engines.jax_engine import JaxEngine  # noqa: E402
from alpa_job.planner import worker  # noqa: E402
from alpa_job.planner.compile_plan import compile_candidate  # noqa: E402
from alpa_job.record import hlo, traffic  # noqa: E402

request = json.loads(sys.argv[1])
config, model, example = worker.build(request)
out = {}
for strategy, mesh in request["candidates"]:
    engine = JaxEngine(config, model, example, strategy, tuple(mesh))
    engine.compile()
    state = engine.init_state(0)
    on_device0 = sum(
        shard.data.nbytes
        for leaf in jax.tree_util.tree_leaves(state)
        for shard in leaf.addressable_shards
        if shard.device == jax.devices()[0]
    )
    # The real engine's compiled step, its collectives counted as the planner counts them (as on GPUs).
    real = {k: 0 for k in hlo.COLLECTIVE_KINDS}
    for row in traffic.step_traffic(engine.stats.hlo_texts[0], 8, request["gpus_per_node"], as_on_gpu=True):
        real[row.kind] += 1
    planned = compile_candidate(config, model, example, strategy, tuple(mesh), request["gpus_per_node"])
    out[f"{strategy}{tuple(mesh)}"] = {
        "real_state_bytes_device0": on_device0,
        "planned_state_bytes": planned["state_bytes_per_device"],
        "real_collectives": real,
        "planned_collectives": {k: v["count"] for k, v in planned["collectives"].items()},
        "real_flops": engine.stats.flops_per_step,
        "planned_flops": planned["flops_per_step"],
    }
print("RESULT " + json.dumps(out))
