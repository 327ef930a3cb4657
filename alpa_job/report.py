"""Assemble the run record from the processes' results and write report.json / .md / .html.

Training returns `ProcessResult`s; this module merges them into the `RunRecord` the user reads
(report.json is `RunRecord.to_dict()`). It never imports an engine, so `inspect` works anywhere.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Dict, Iterable, Optional

from alpa_job.errors import KitError
from alpa_job.inspect import plots, render
from alpa_job.inspect.record import RunRecord

REPORT_FILE = "report.json"


def build_report(config, results: Iterable[Any], address: Optional[str] = None) -> RunRecord:
    """Merge per-process results (ProcessResult, or the plain dicts of older producers) into one record."""
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return RunRecord.from_processes(results, config.as_dict(), created=created, address=address)


def failed_report(config, engine: str, status: str, error: str, steps_done: int,
                  address: Optional[str] = None) -> RunRecord:
    """The record of a run that stopped part-way: what was asked, how far it got, and why it stopped."""
    from alpa_job import versions

    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = RunRecord(engine=engine, strategy=config.strategy, requested_strategy=config.strategy,
                       steps=int(steps_done or 0), config=config.as_dict(), created=created, address=address,
                       status=status, error=error, versions=versions.collect())
    record.summary = record.summarize()
    return record


def report_json(record: RunRecord) -> str:
    return json.dumps(record.to_dict(), indent=2, sort_keys=False, default=str)


def write_report(record: RunRecord, out_dir: str) -> Dict[str, str]:
    """Write report.json, report.md, report.html and the plot PNGs; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, REPORT_FILE), "md": os.path.join(out_dir, "report.md"),
             "html": os.path.join(out_dir, "report.html")}
    _write_text(paths["json"], report_json(record))
    _write_text(paths["md"], render.to_markdown(record))
    rendered = plots.all_plots(record)
    for name, _caption, png in rendered:
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(png)
    _write_text(paths["html"], render.to_html(record, rendered))
    return paths


def _write_text(path: str, text: str) -> None:
    # Write beside, then rename: a crash mid-write never leaves a half report over a good one.
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_report(run_dir: str) -> RunRecord:
    """The RunRecord of a run directory (or a report.json path)."""
    path = os.path.join(run_dir, REPORT_FILE) if os.path.isdir(run_dir) else run_dir
    if not os.path.isfile(path):
        raise KitError(f"{run_dir}: no {REPORT_FILE}; point inspect at a run directory (the --out of a train run) "
                       "or at an Alpa dump_debug_info folder")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise KitError(f"{path}: not valid JSON (line {err.lineno}); re-run the job or restore the file") from None
    return RunRecord.from_dict(data, where=path)
