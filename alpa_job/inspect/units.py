"""Human units and the plan's one-line name, shared by the report and the run comparison."""
from __future__ import annotations

from alpa_job.units import human_bytes  # noqa: F401 - the readers' name for it


def mesh_text(shape) -> str:
    return "×".join(str(s) for s in shape) if shape else "?"


def plan_title(record) -> str:
    """'auto → tensor (2×4)' for an auto run, 'fsdp (8×1)' otherwise; Alpa: its method and stage count."""
    chosen = f"{record.strategy} ({mesh_text(record.mesh.shape)})"
    if record.engine == "alpa" and record.stages:
        chosen = f"{record.strategy} ({len(record.stages)} stage{'s' if len(record.stages) != 1 else ''})"
    requested = record.requested_strategy or (record.config or {}).get("strategy")
    if requested and requested != record.strategy and requested in ("auto", "pipeshard-auto"):
        return f"{requested} → {chosen}"
    return chosen
