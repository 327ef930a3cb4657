"""Assemble the run report from the processes' results and write report.json / .md / .html.

Training returns plain data; this module turns it into the report the user reads. It never
imports an engine, so `inspect` works on any machine.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Dict, List

from alpa_job.errors import KitError
from alpa_job.inspect import plots, render

REPORT_FILE = "report.json"


def build_report(config, results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Merge per-process results (process 0 first) into one report."""
    results = sorted(results, key=lambda r: r["process"]["id"])
    lead = dict(results[0])
    lead.pop("final_state", None)
    lead["processes"] = [r["process"] for r in results]
    lead["config"] = config.as_dict()
    lead["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lead["summary"] = summarize(lead)
    return lead


def summarize(report: Dict[str, Any]) -> Dict[str, Any]:
    rows = report.get("params", [])
    counts: Dict[str, Dict[str, int]] = {"params": {}, "opt_state": {}}
    for row in rows:
        group = row["path"].split("/", 1)[0]
        if group in counts:
            counts[group][row["strategy"]] = counts[group].get(row["strategy"], 0) + 1
    losses = report.get("losses") or []
    processes = report.get("processes") or []
    return {
        "state_bytes": sum(r["bytes"] for r in rows),
        "state_bytes_per_device": sum(r["bytes_per_device"] for r in rows),
        "param_count": sum(_numel(r["shape"]) for r in rows if r["path"].startswith("params/")),
        "strategy_counts": counts,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "processes": len(processes) or 1,
        "hosts": len({p.get("ip") or p.get("host") for p in processes}) or 1,
        "devices": (report.get("devices") or {}).get("count"),
        "one_compile": report.get("compiles") == 1 and not report.get("backend_compiles_during_loop"),
    }


def _numel(shape: List[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_report(report: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    """Write report.json, report.md, report.html and the plot PNGs; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, REPORT_FILE), "md": os.path.join(out_dir, "report.md"),
             "html": os.path.join(out_dir, "report.html")}
    _write_text(paths["json"], json.dumps(report, indent=2, sort_keys=False, default=str))
    _write_text(paths["md"], render.to_markdown(report))
    rendered = plots.all_plots(report)
    for name, _caption, png in rendered:
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(png)
    _write_text(paths["html"], render.to_html(report, rendered))
    return paths


def _write_text(path: str, text: str) -> None:
    # Write beside, then rename: a crash mid-write never leaves a half report over a good one.
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_report(run_dir: str) -> Dict[str, Any]:
    path = os.path.join(run_dir, REPORT_FILE) if os.path.isdir(run_dir) else run_dir
    if not os.path.isfile(path):
        raise KitError(f"{run_dir}: no {REPORT_FILE}; point inspect at a run directory (the --out of a train run) "
                       "or at an Alpa dump_debug_info folder")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise KitError(f"{path}: not valid JSON (line {err.lineno}); re-run the job or restore the file") from None
