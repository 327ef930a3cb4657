"""The readers: `python -m alpa_job inspect PATH [--compare ...]`, and the report files a run leaves.

Each reads the typed run record (`alpa_job.record`), whoever produced it: a training run of either
engine, or an Alpa dump folder. None imports an engine, so they work on a laptop with no GPU.

- load.py: a run directory, a report.json or an Alpa dump folder -> one `RunRecord`;
- render.py: the record as a terminal table, Markdown or a self-contained HTML page;
- plots.py: its PNG plots; mesh_picture.py: the device grid and who holds which slice;
- compare.py: several runs side by side; units.py: human units and the plan's one-line name;
- write.py: report.json, report.md, report.html and the plots, written into a run directory.
"""
