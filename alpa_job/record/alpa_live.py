"""In-process Alpa inspection: a live executable's placement specs -> the engine-neutral plan.

`executable.get_input_placement_specs()` / `get_output_placement_specs()` return pytrees of
`alpa.parallel_plan.PlacementSpec`; `dump_debug_info` writes exactly `str()` of those trees.
So the live path feeds the same text through the offline dump reader (`alpa_dump`), which makes
the labels (DP / ZeRO / MP / MP+ZeRO / replicated), paths (params/..., opt_state/...) and mesh
axes identical between a live run, `inspect DUMP_DIR` and the JAX engine's report.

No `import alpa` here; works with any objects whose `str()` is Alpa's print format.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, List, Optional, Sequence

from alpa_job.record.alpa_dump import INPUT_SUFFIX, OUTPUT_SUFFIX, AlpaDump, load_alpa_dump
from alpa_job.record.run_record import StageRecord

PREFIX = "train_step"


def dump_from_placement_specs(input_specs: Any, output_specs: Any = None) -> AlpaDump:
    """Read live PlacementSpec trees ((state, batch) in, (state, loss) out) into an AlpaDump."""
    with tempfile.TemporaryDirectory(prefix="alpa_live_") as folder:
        with open(os.path.join(folder, PREFIX + INPUT_SUFFIX), "w") as f:
            f.write(str(input_specs))
        if output_specs is not None:
            with open(os.path.join(folder, PREFIX + OUTPUT_SUFFIX), "w") as f:
                f.write(str(output_specs))
        return load_alpa_dump(folder, prefix=PREFIX)


def plan_from_executable(executable: Any):
    """The ParallelPlan of a compiled Alpa executable (shard-parallel or pipeshard)."""
    return dump_from_placement_specs(executable.get_input_placement_specs(), executable.get_output_placement_specs()).plan


def stage_layout(dp_result: Optional[Sequence[Any]], stage_memory_bytes: Optional[Sequence[int]] = None) -> List[StageRecord]:
    """Forward stage -> layers, submesh, logical mesh, auto-sharding options (+ memory per stage).

    `dp_result` is get_last_dp_result() (or the plan cache's four parts with a leading None).
    `stage_memory_bytes` is the pipeshard executable's get_stage_allocation_size(): one entry per
    stage, forward stages first then backward stages (stage i and 2n-1-i share mesh i).
    """
    if not dp_result or dp_result[1] is None:
        return []
    _, layer_ids, submesh, logical, options = dp_result
    n = len(layer_ids)
    rows = []
    for i in range(n):
        row = StageRecord(
            stage=i,
            mesh=i,
            layers=list(layer_ids[i]),
            submesh_shape=list(submesh[i]) if submesh else None,
            logical_shape=list(logical[i]) if logical else None,
            autosharding_options=dict(options[i]) if options else {},
        )
        if stage_memory_bytes and len(stage_memory_bytes) >= 2 * n:
            row.memory_bytes_forward = int(stage_memory_bytes[i])
            row.memory_bytes_backward = int(stage_memory_bytes[2 * n - 1 - i])
            row.memory_bytes = row.memory_bytes_forward + row.memory_bytes_backward
        rows.append(row)
    return rows
