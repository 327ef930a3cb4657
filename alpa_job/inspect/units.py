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


def stage_blocks_text(row) -> str:
    """A pipeline stage's blocks: 'Block_0..Block_1', or its chunks under a circular schedule
    ('Block_0 + Block_2'). Reports written before chunks existed list the blocks alone."""

    def span(names):
        return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"

    return " + ".join(span(chunk) for chunk in row.get("chunks") or [row["blocks"]] if chunk)
