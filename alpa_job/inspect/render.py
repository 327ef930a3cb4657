"""Render a report dict as a terminal table, Markdown or a self-contained HTML page.

The report is plain data (report.json); nothing here imports an engine.
"""
from __future__ import annotations

import base64
import html
import json
from typing import Dict, List, Sequence

from alpa_job.inspect import plots

PARAM_COLUMNS = ("path", "shape", "dtype", "bytes", "bytes_per_device", "spec", "mesh_ids", "strategy")


def _cell(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def summary_pairs(report: Dict) -> List[tuple]:
    s = report.get("summary", {})
    pairs = [
        ("engine / strategy", f"{report.get('engine')} / {report.get('strategy')}"),
        ("mesh", f"{'x'.join(map(str, report.get('mesh', {}).get('shape', [])))} "
                 f"{tuple(report.get('mesh', {}).get('axes', []))}"),
        ("processes / hosts / devices", f"{s.get('processes')} / {s.get('hosts')} / {s.get('devices')}"),
        ("compiles (train step)", report.get("compiles")),
        ("compile seconds", report.get("compile_seconds")),
        ("steps", report.get("steps")),
        ("samples seen / dropped", f"{report.get('samples_seen')} / {report.get('samples_dropped')}"),
        ("step time (s)", report.get("step_time_s")),
        ("throughput (samples/s)", report.get("throughput")),
        ("loss first -> last", f"{s.get('loss_first')} -> {s.get('loss_last')}"),
        ("state bytes total / per device", f"{s.get('state_bytes')} / {s.get('state_bytes_per_device')}"),
        ("strategy counts (params)", s.get("strategy_counts", {}).get("params")),
        ("strategy counts (opt_state)", s.get("strategy_counts", {}).get("opt_state")),
    ]
    return [(k, _cell(v) if not isinstance(v, dict) else json.dumps(v)) for k, v in pairs]


def _collective_rows(report: Dict) -> List[List[str]]:
    return [[kind, _cell(v.get("count")), _cell(v.get("bytes"))] for kind, v in (report.get("collectives") or {}).items()]


def _search_rows(report: Dict) -> List[List[str]]:
    return [[r["strategy"], _cell(r["mesh_shape"]), _cell(r.get("fits")), _cell(r.get("peak_bytes_per_device")),
             _cell(r.get("compile_s")), _cell(r.get("step_time_s")), "yes" if r.get("chosen") else "", r.get("note", "")]
            for r in (report.get("search") or [])]


SEARCH_HEADER = ("strategy", "mesh", "fits", "peak B/device", "compile s", "step s", "chosen", "note")


def _process_rows(report: Dict) -> List[List[str]]:
    return [[_cell(p.get("id")), p.get("host", ""), _cell(p.get("ip")), _cell(len(p.get("local_devices", []))),
             _cell(p.get("coordinator"))] for p in (report.get("processes") or [])]


PROCESS_HEADER = ("process", "host", "ip", "devices", "coordinator")


# ----- Markdown ------------------------------------------------------------------------------------
def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(x: str) -> str:
        return str(x).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def to_markdown(report: Dict) -> str:
    parts = [f"# Parallel plan report: {report.get('config', {}).get('model', '?')}", "",
             _md_table(("item", "value"), summary_pairs(report)), ""]
    if report.get("search"):
        parts += ["## Auto search", "", _md_table(SEARCH_HEADER, _search_rows(report)), ""]
    if report.get("processes"):
        parts += ["## Processes", "", _md_table(PROCESS_HEADER, _process_rows(report)), ""]
    parts += ["## Collectives in the optimized HLO", "", _md_table(("kind", "count", "bytes"), _collective_rows(report)), ""]
    parts += ["## Parameters and optimizer state", "",
              _md_table(PARAM_COLUMNS, [[_cell(r.get(c)) for c in PARAM_COLUMNS] for r in report.get("params", [])]), ""]
    return "\n".join(parts)


# ----- terminal table ------------------------------------------------------------------------------
def to_table(report: Dict) -> str:
    """A plain-text rendering (rich when available; the legacy image may not have it)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return to_markdown(report)
    console = Console(record=True, width=160, file=_NullFile())
    summary = Table(title="run summary", show_header=False)
    for k, v in summary_pairs(report):
        summary.add_row(k, v)
    console.print(summary)
    if report.get("search"):
        t = Table(*SEARCH_HEADER, title="auto search")
        for row in _search_rows(report):
            t.add_row(*row)
        console.print(t)
    params = Table(*PARAM_COLUMNS, title="parameters and optimizer state")
    for r in report.get("params", []):
        params.add_row(*[_cell(r.get(c)) for c in PARAM_COLUMNS])
    console.print(params)
    coll = Table("kind", "count", "bytes", title="collectives")
    for row in _collective_rows(report):
        coll.add_row(*row)
    console.print(coll)
    return console.export_text()


class _NullFile:
    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


# ----- HTML ----------------------------------------------------------------------------------------
def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], css_class: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{css_class}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def to_html(report: Dict, rendered_plots: Sequence[tuple] = None) -> str:
    if rendered_plots is None:
        rendered_plots = plots.all_plots(report)
    figures = "".join(
        f'<figure><img alt="{html.escape(caption)}" onload="this.dataset.rendered=this.naturalWidth" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        for _name, caption, png in rendered_plots)
    param_rows = [[_cell(r.get(c)) for c in PARAM_COLUMNS] for r in report.get("params", [])]
    sections = [
        "<h2>Summary</h2>", _html_table(("item", "value"), summary_pairs(report), "summary"),
        "<h2>Plots</h2>", figures or "<p>no plots</p>",
    ]
    if report.get("search"):
        sections += ["<h2>Auto search</h2>", _html_table(SEARCH_HEADER, _search_rows(report), "search")]
    if report.get("processes"):
        sections += ["<h2>Processes</h2>", _html_table(PROCESS_HEADER, _process_rows(report), "processes")]
    sections += ["<h2>Collectives in the optimized HLO</h2>",
                 _html_table(("kind", "count", "bytes"), _collective_rows(report), "collectives"),
                 "<h2>Parameters and optimizer state</h2>",
                 _html_table(PARAM_COLUMNS, param_rows, "params")]
    title = f"Parallel plan: {report.get('config', {}).get('model', '?')} / {report.get('strategy')}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; }}
th {{ background: #f0f0f0; }}
td:nth-child(8) {{ font-weight: 600; }}
figure {{ display: inline-block; margin: 0 1em 1em 0; }}
</style></head>
<body><h1>{html.escape(title)}</h1>
{''.join(sections)}
</body></html>
"""
