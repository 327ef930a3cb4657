"""The readers: `python -m alpa_job inspect PATH [--compare ...]`, and the report files a run leaves.

Each reads the typed run record (`alpa_job.record`), whoever produced it: a training run of either
engine, or an Alpa dump folder. None imports an engine, so they work on a laptop with no GPU.

- load.py: a run directory, a report.json or an Alpa dump folder -> one `RunRecord`;
- render.py: the record as a terminal table, Markdown or a self-contained HTML page;
- plots.py: its PNG plots; mesh_picture.py: the device grid and who holds which slice;
- compare.py: several runs side by side; units.py: human units and the plan's one-line name;
- write.py: report.json, report.md, report.html and the plots, written into a run directory;
- program.py: `plan_of`, the record of any JAX program (a user's own jitted step), no trainer needed.

`plan_of` and `write_report` are importable from here; they load on first use, so importing the
readers stays light (no jax until a program is inspected).
"""

from __future__ import annotations

from typing import Any

__all__ = ["plan_of", "write_report"]


def __getattr__(name: str) -> Any:
    if name == "plan_of":
        from alpa_job.inspect.program import plan_of

        return plan_of
    if name == "write_report":
        from alpa_job.inspect.write import write_report

        return write_report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
