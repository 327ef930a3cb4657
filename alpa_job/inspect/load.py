"""Load what `inspect` is pointed at: a run directory, a report.json, or an Alpa dump folder."""
from __future__ import annotations

import glob
import os
from typing import Any, Dict

from alpa_job.report import load_report, summarize


def load_any(path: str) -> Dict[str, Any]:
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "report.json")) and \
            glob.glob(os.path.join(path, "*_placement_specs.txt")):
        return alpa_dump_report(path)
    return load_report(path)


def alpa_dump_report(path: str) -> Dict[str, Any]:
    """A report (same format as a training run's) from an Alpa dump_debug_info folder."""
    from alpa_job.inspect.alpa_dump import load_alpa_dump

    dump = load_alpa_dump(path)
    plan = dump.plan
    report: Dict[str, Any] = {
        "engine": "alpa",
        "strategy": "alpa-dump",
        "source": os.path.abspath(path),
        "mesh": plan.mesh_rows()[0] if plan.meshes else {},
        "meshes": plan.mesh_rows(),
        "params": plan.leaf_rows(),
        "batch_sharding": plan.batch_rows(),
        "collectives": getattr(dump, "collectives", None),
        "memory": getattr(dump, "memory", None),
        "stages": getattr(dump, "stages", None),
        "config": {"model": os.path.basename(os.path.abspath(path))},
    }
    report["summary"] = summarize(report)
    return report
