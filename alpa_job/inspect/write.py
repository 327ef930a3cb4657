"""Write a run's report files: report.json, report.md, report.html and the plot PNGs beside them."""

from __future__ import annotations

import os
from typing import Dict

from alpa_job.inspect.plots import all_plots
from alpa_job.inspect.render import to_html, to_markdown
from alpa_job.record.report_file import REPORT_FILE, report_json
from alpa_job.record.run_record import RunRecord


def write_report(record: RunRecord, out_dir: str) -> Dict[str, str]:
    """Write report.json, report.md, report.html and the plot PNGs; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": os.path.join(out_dir, REPORT_FILE),
        "md": os.path.join(out_dir, "report.md"),
        "html": os.path.join(out_dir, "report.html"),
    }
    _write_text(paths["json"], report_json(record))
    _write_text(paths["md"], to_markdown(record))
    rendered = all_plots(record)
    for name, _caption, png in rendered:
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(png)
    _write_text(paths["html"], to_html(record, rendered))
    return paths


def _write_text(path: str, text: str) -> None:
    # Write beside, then rename: a crash mid-write never leaves a half report over a good one.
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
