"""Render a RunRecord as a terminal table, Markdown or a self-contained HTML page.

Reads the typed record (alpa_job.inspect.record); nothing here imports an engine.
"""
from __future__ import annotations

import base64
import html
import json
from typing import List, Optional, Sequence

from alpa_job.inspect import plots
from alpa_job.inspect.record import MemoryRecord, RunRecord

PARAM_COLUMNS = ("path", "shape", "dtype", "bytes", "bytes_per_device", "spec", "mesh_ids", "strategy")


def _cell(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def summary_pairs(record: RunRecord) -> List[tuple]:
    s = record.summary
    pairs = [
        ("engine / strategy", f"{record.engine} / {record.strategy}"),
        ("mesh", f"{'x'.join(map(str, record.mesh.shape))} {tuple(record.mesh.axes)}"),
        ("processes / hosts / devices", f"{s.processes} / {s.hosts} / {s.devices}"),
        ("compiles (train step)", record.compiles),
        ("compile seconds", record.compile_seconds),
        ("steps", record.steps),
        ("samples seen / dropped", f"{record.samples_seen} / {record.samples_dropped}"),
        ("step time (s)", record.step_time_s),
        ("throughput (samples/s)", record.throughput),
        ("loss first -> last", f"{s.loss_first} -> {s.loss_last}"),
        ("state bytes total / per device", f"{s.state_bytes} / {s.state_bytes_per_device}"),
        ("strategy counts (params)", s.strategy_counts.get("params")),
        ("strategy counts (opt_state)", s.strategy_counts.get("opt_state")),
        ("memory", _memory_text(record.memory)),
    ]
    if record.eval_loss is not None:
        pairs.append(("eval loss", record.eval_loss))
    if record.source:
        pairs.append(("source", record.source))
    return [(k, _cell(v) if not isinstance(v, dict) else json.dumps(v)) for k, v in pairs]


def _memory_text(memory: Optional[MemoryRecord]) -> str:
    if memory is None:
        return "not measured"
    parts = []
    if memory.peak_estimate_bytes is not None:
        parts.append(f"peak estimate {memory.peak_estimate_bytes} B/device")
    if memory.total_allocation_bytes is not None:
        parts.append(f"allocation {memory.total_allocation_bytes} B")
    if memory.stage_allocation_bytes:
        parts.append(f"per stage {_cell(memory.stage_allocation_bytes)} B")
    return ", ".join(parts) or "not measured"


def _collective_rows(record: RunRecord) -> List[List[str]]:
    return [[kind, _cell(c.count), _cell(c.bytes)] for kind, c in (record.collectives or {}).items()]


def _search_rows(record: RunRecord) -> List[List[str]]:
    return [[r.strategy, _cell(r.mesh_shape), _cell(r.fits), _cell(r.peak_bytes_per_device),
             _cell(r.compile_s), _cell(r.step_time_s), "yes" if r.chosen else "", r.note]
            for r in (record.search or [])]


SEARCH_HEADER = ("strategy", "mesh", "fits", "peak B/device", "compile s", "step s", "chosen", "note")


def _process_rows(record: RunRecord) -> List[List[str]]:
    return [[_cell(p.id), p.host or "", _cell(p.ip), _cell(len(p.local_devices)), _cell(p.coordinator)]
            for p in record.processes]


PROCESS_HEADER = ("process", "host", "ip", "devices", "coordinator")


def _stage_rows(record: RunRecord) -> List[List[str]]:
    return [[_cell(st.stage), _cell(st.mesh), _cell(st.layers), _cell(st.submesh_shape), _cell(st.logical_shape),
             _cell(st.memory_bytes), _cell(st.memory_bytes_forward), _cell(st.memory_bytes_backward),
             _cell(sum(c.count for c in st.collectives.values()) if st.collectives else None)]
            for st in record.stages]


STAGE_HEADER = ("stage", "mesh", "layers", "submesh", "logical mesh", "memory B", "forward B", "backward B",
                "collectives")


def _param_rows(record: RunRecord) -> List[List[str]]:
    return [[_cell(getattr(r, c)) for c in PARAM_COLUMNS] for r in record.params]


# ----- Markdown ------------------------------------------------------------------------------------
def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(x: str) -> str:
        return str(x).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def to_markdown(record: RunRecord) -> str:
    parts = [f"# Parallel plan report: {record.config.get('model', '?')}", "",
             _md_table(("item", "value"), summary_pairs(record)), ""]
    if record.search:
        parts += ["## Auto search", "", _md_table(SEARCH_HEADER, _search_rows(record)), ""]
    if record.processes:
        parts += ["## Processes", "", _md_table(PROCESS_HEADER, _process_rows(record)), ""]
    if record.stages:
        parts += ["## Pipeline stages", "", _md_table(STAGE_HEADER, _stage_rows(record)), ""]
    parts += ["## Collectives in the optimized HLO", "", _md_table(("kind", "count", "bytes"), _collective_rows(record)), ""]
    parts += ["## Parameters and optimizer state", "", _md_table(PARAM_COLUMNS, _param_rows(record)), ""]
    return "\n".join(parts)


# ----- terminal table ------------------------------------------------------------------------------
def to_table(record: RunRecord) -> str:
    """A plain-text rendering (rich when available; the legacy image may not have it)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return to_markdown(record)
    console = Console(record=True, width=160, file=_NullFile())
    summary = Table(title="run summary", show_header=False)
    for k, v in summary_pairs(record):
        summary.add_row(k, v)
    console.print(summary)
    tables = [(SEARCH_HEADER, _search_rows(record), "auto search"),
              (STAGE_HEADER, _stage_rows(record), "pipeline stages"),
              (PARAM_COLUMNS, _param_rows(record), "parameters and optimizer state"),
              (("kind", "count", "bytes"), _collective_rows(record), "collectives")]
    for header, rows, title in tables:
        if rows or title in ("parameters and optimizer state", "collectives"):
            t = Table(*header, title=title)
            for row in rows:
                t.add_row(*row)
            console.print(t)
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


def to_html(record: RunRecord, rendered_plots: Optional[Sequence[tuple]] = None) -> str:
    if rendered_plots is None:
        rendered_plots = plots.all_plots(record)
    figures = "".join(
        f'<figure><img alt="{html.escape(caption)}" onload="this.dataset.rendered=this.naturalWidth" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        for _name, caption, png in rendered_plots)
    sections = [
        "<h2>Summary</h2>", _html_table(("item", "value"), summary_pairs(record), "summary"),
        "<h2>Plots</h2>", figures or "<p>no plots</p>",
    ]
    if record.search:
        sections += ["<h2>Auto search</h2>", _html_table(SEARCH_HEADER, _search_rows(record), "search")]
    if record.processes:
        sections += ["<h2>Processes</h2>", _html_table(PROCESS_HEADER, _process_rows(record), "processes")]
    if record.stages:
        sections += ["<h2>Pipeline stages</h2>", _html_table(STAGE_HEADER, _stage_rows(record), "stages")]
    sections += ["<h2>Collectives in the optimized HLO</h2>",
                 _html_table(("kind", "count", "bytes"), _collective_rows(record), "collectives"),
                 "<h2>Parameters and optimizer state</h2>",
                 _html_table(PARAM_COLUMNS, _param_rows(record), "params")]
    title = f"Parallel plan: {record.config.get('model', '?')} / {record.strategy}"
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
