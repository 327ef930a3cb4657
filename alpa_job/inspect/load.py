"""Load what `inspect` is pointed at -- a run directory, a report.json, or an Alpa dump folder --
as one `RunRecord` (the same type a training run writes)."""

from __future__ import annotations

import glob
import os
from typing import List, Optional

from alpa_job.record.hlo import merge_counts
from alpa_job.record.run_record import GIB, Collective, DeviceInfo, MemoryRecord, MeshShape, RunRecord, StageRecord
from alpa_job.record.report_file import load_report


def load_any(path: str) -> RunRecord:
    if (
        os.path.isdir(path)
        and not os.path.isfile(os.path.join(path, "report.json"))
        and glob.glob(os.path.join(glob.escape(path), "*_placement_specs.txt"))
    ):
        return alpa_dump_report(path)
    return load_report(path)


def alpa_dump_report(path: str) -> RunRecord:
    """The run record of an Alpa dump_debug_info folder: plan, collectives, memory, stages."""
    from alpa_job.record.alpa_dump import load_alpa_dump

    return record_from_dump(load_alpa_dump(path), source=os.path.abspath(path))


def record_from_dump(dump, source: Optional[str] = None) -> RunRecord:
    """A RunRecord from an `AlpaDump` (read from a folder, or from a live executable's specs)."""
    plan = dump.plan
    meshes = plan.mesh_records()
    stage_bytes = _stage_bytes(dump)
    record = RunRecord(
        engine="alpa",
        strategy="alpa-dump",
        mesh=MeshShape(shape=list(meshes[0].shape), axes=list(meshes[0].axes)) if meshes else MeshShape(),
        meshes=meshes,
        params=plan.leaf_records(),
        batch_sharding=plan.batch_records(),
        collectives=Collective.table(dump.collectives) if dump.stage_collectives else None,
        memory=_memory(dump.kind, stage_bytes),
        stages=dump_stages(dump, stage_bytes),
        alpa_method={"dump_kind": dump.kind, "prefix": dump.prefix},
        devices=DeviceInfo(count=sum(m.devices for m in meshes) or None),
        source=source or os.path.abspath(dump.folder),
        config={"model": os.path.basename(os.path.abspath(source or dump.folder))},
    )
    record.summary = record.summarize()
    return record


def _memory(kind: str, stage_bytes: List[int]) -> Optional[MemoryRecord]:
    if not stage_bytes:
        return None  # the dump has no *.mem_usage.txt
    if kind == "pipeshard":
        return MemoryRecord.from_stage_bytes(stage_bytes)
    return MemoryRecord.from_stage_bytes(total_bytes=stage_bytes[0])


def _stage_bytes(dump) -> List[int]:
    """Bytes of each *.mem_usage.txt in stage order (Alpa writes GiB with 3 decimals: +-0.5 MiB)."""
    return [int(round(gb * GIB)) for gb in dump.memory_gb.values()]


def dump_stages(dump, stage_bytes: List[int]) -> List[StageRecord]:
    """Stages of a dump. Pipeshard: Alpa's executable stages are the n forward stages then the n
    backward ones (stage i and 2n-1-i run on mesh i), so forward stage i pairs with 2n-1-i.
    Shard parallel: the whole step is one stage on mesh 0."""
    meshes = dump.plan.mesh_records()
    if dump.kind != "pipeshard":
        if not meshes:
            return []
        return [
            StageRecord(
                stage=0,
                mesh=meshes[0].id,
                submesh_shape=list(meshes[0].shape),
                memory_bytes=stage_bytes[0] if stage_bytes else None,
                collectives=Collective.table(dump.collectives) if dump.stage_collectives else None,
            )
        ]
    stems = list(dump.stage_collectives)  # <prefix>_stage_<i>, in stage order
    memory = dict(zip(dump.memory_gb, stage_bytes))
    n = len(meshes)
    if n == 0 or len(stems) < 2 * n:  # not the forward/backward layout: one row per executable stage
        return [
            StageRecord(stage=i, memory_bytes=memory.get(stem), collectives=Collective.table(dump.stage_collectives[stem]))
            for i, stem in enumerate(stems)
        ]
    rows = []
    for i, mesh in enumerate(meshes):
        forward, backward = stems[i], stems[2 * n - 1 - i]
        fwd, bwd = memory.get(forward), memory.get(backward)
        rows.append(
            StageRecord(
                stage=i,
                mesh=mesh.id,
                submesh_shape=list(mesh.shape),
                memory_bytes=None if fwd is None or bwd is None else fwd + bwd,
                memory_bytes_forward=fwd,
                memory_bytes_backward=bwd,
                collectives=Collective.table(merge_counts(dump.stage_collectives[forward], dump.stage_collectives[backward])),
            )
        )
    return rows
