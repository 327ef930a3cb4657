"""`inspect --compare RUN RUN...`: one table and one set of plots across runs, the way a user decides
between data, fsdp and tensor on their model.

Each row is a run's record reduced to what differs between strategies: step time, throughput, state
bytes per device and XLA's peak estimate, the parameters' strategy labels (DP/ZeRO/MP counts),
collectives (count and bytes), compile time, the final loss, the run's status; and, where a run recorded
them, the input's wait per step and the final eval loss. Rendered as a terminal table, Markdown, JSON or a
self-contained HTML page.
"""

from __future__ import annotations

import html
import os
from typing import Any, Dict, List, Optional, Sequence

from alpa_job.errors import KitError
from alpa_job.record.run_record import RunRecord
from alpa_job.inspect.units import human_bytes, plan_title
from alpa_job import strict_json

COLUMNS = (
    "run",
    "plan",
    "status",
    "steps",
    "step ms",
    "samples/s",
    "state / device",
    "peak / device",
    "labels (params)",
    "collectives",
    "collective bytes",
    "compile s",
    "loss last",
)
# Shown only when some run has them: runs from before the input pipeline and runs without an eval split
# compare as they always did.
OPTIONAL_COLUMNS = (("data_wait_ms", "data wait ms / step"), ("eval_loss", "eval loss"))


def load_runs(paths: Sequence[str]) -> List[RunRecord]:
    from alpa_job.inspect.load import load_any

    if len(paths) < 2:
        raise KitError("--compare needs at least two run directories (python -m alpa_job inspect --compare RUN RUN)")
    return [load_any(p) for p in paths]


def labels(paths: Sequence[str]) -> List[str]:
    """Each run's folder name (a symlink such as runs/latest: the folder it points at)."""
    names = [os.path.basename(os.path.realpath(p.rstrip("/"))) or p for p in paths]
    return [n if names.count(n) == 1 else p for n, p in zip(names, paths)]


def row(label: str, record: RunRecord) -> Dict[str, Any]:
    """One run's comparable numbers (plain data; None where the run did not measure it)."""
    collectives = record.collectives or {}
    memory = record.memory
    return {
        "run": label,
        "plan": plan_title(record),
        "status": record.status,
        "steps": record.steps,
        "step_ms": None if record.step_time_s is None else round(record.step_time_s * 1e3, 3),
        "throughput": record.throughput,
        "state_bytes_per_device": record.summary.state_bytes_per_device or None,
        "peak_bytes_per_device": memory.peak_estimate_bytes if memory else None,
        "collective_count": sum(c.count for c in collectives.values()) if record.collectives is not None else None,
        "collective_bytes": sum(c.bytes for c in collectives.values()) if record.collectives is not None else None,
        "collectives": {k: c.count for k, c in collectives.items()},
        "labels": dict(record.summary.strategy_counts.get("params") or {}),  # DP / ZeRO / MP / MP+ZeRO counts
        "compile_s": record.compile_seconds,
        "loss_last": record.summary.loss_last,
        "data_wait_ms": _data_wait_ms(record),
        "eval_loss": record.evals[-1].loss if record.evals else record.eval_loss,
    }


def _data_wait_ms(record: RunRecord) -> Optional[float]:
    wait = record.input.data_wait_per_step_s if record.input else None
    return None if wait is None else round(wait * 1e3, 4)


def rows(paths: Sequence[str]) -> List[Dict[str, Any]]:
    records = load_runs(paths)
    return [row(label, record) for label, record in zip(labels(paths), records)]


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return human_bytes(value)
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def optional_keys(data: List[Dict[str, Any]]) -> List[str]:
    return [key for key, _title in OPTIONAL_COLUMNS if any(r.get(key) is not None for r in data)]


def columns(data: List[Dict[str, Any]]) -> List[str]:
    """The table's header: COLUMNS, then the optional ones some run measured."""
    titles = dict(OPTIONAL_COLUMNS)
    return list(COLUMNS) + [titles[key] for key in optional_keys(data)]


def table_rows(data: List[Dict[str, Any]]) -> List[List[str]]:
    extra = optional_keys(data)
    out = []
    for r in data:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["collectives"].items()) if n) or "none"
        out.append(
            [
                r["run"],
                r["plan"],
                r["status"],
                _fmt(r["steps"]),
                _fmt(r["step_ms"]),
                _fmt(r["throughput"]),
                _fmt(r["state_bytes_per_device"], "bytes"),
                _fmt(r["peak_bytes_per_device"], "bytes"),
                ", ".join(f"{k} {n}" for k, n in sorted(r["labels"].items())) or "-",
                "-" if r["collective_count"] is None else f"{r['collective_count']} ({kinds})",
                _fmt(r["collective_bytes"], "bytes"),
                _fmt(r["compile_s"]),
                _fmt(r["loss_last"]),
            ]
            + [_fmt(r.get(key)) for key in extra]
        )
    return out


def fastest(data: List[Dict[str, Any]]) -> Optional[str]:
    timed = [r for r in data if r["step_ms"] and r["status"] == "ok"]
    return min(timed, key=lambda r: r["step_ms"])["run"] if timed else None


def to_text(data: List[Dict[str, Any]]) -> str:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return to_markdown(data)
    from alpa_job.inspect.render import _NullFile

    console = Console(record=True, width=240, file=_NullFile())
    t = Table(title="runs compared")
    for n, title in enumerate(columns(data)):
        # The run's name is what the reader looks up (and copies): other columns wrap before it does.
        t.add_column(title, no_wrap=n == 0)
    for cells in table_rows(data):
        t.add_row(*cells)
    console.print(t)
    best = fastest(data)
    if best:
        console.print(f"fastest step: {best}")
    return console.export_text()


def to_markdown(data: List[Dict[str, Any]]) -> str:
    from alpa_job.inspect.render import _md_table

    best = fastest(data)
    parts = ["# Runs compared", "", _md_table(columns(data), table_rows(data)), ""]
    if best:
        parts += [f"Fastest step: **{best}**.", ""]
    return "\n".join(parts)


def plot_png(data: List[Dict[str, Any]]) -> Optional[bytes]:
    """One figure, a bar chart per measure, a bar per run."""
    measures = [
        ("step_ms", "step time (ms)", 1),
        ("throughput", "samples/s", 1),
        ("state_bytes_per_device", "state MiB / device", 2**-20),
        ("peak_bytes_per_device", "peak MiB / device (XLA)", 2**-20),
        ("collective_bytes", "collective MiB", 2**-20),
        ("compile_s", "compile s", 1),
        ("data_wait_ms", "data wait ms / step", 1),
        ("eval_loss", "eval loss", 1),
    ]
    measures = [m for m in measures if any(r.get(m[0]) is not None for r in data)]
    if not measures:
        return None
    from alpa_job.inspect.plots import _figure_png, _pyplot

    plt = _pyplot()
    cols = min(3, len(measures))
    rows_n = (len(measures) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.4 * cols, 3.1 * rows_n), squeeze=False)
    for ax in axes.flat[len(measures) :]:
        ax.set_visible(False)
    names = [r["run"] if len(r["run"]) <= 18 else "…" + r["run"][-17:] for r in data]
    colors = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"]
    for ax, (key, title, scale) in zip(axes.flat, measures):
        values = [(r[key] or 0) * scale for r in data]
        ax.bar(range(len(data)), values, color=[colors[i % len(colors)] for i in range(len(data))])
        ax.set_xticks(range(len(data)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _figure_png(fig)


def to_html(data: List[Dict[str, Any]]) -> str:
    from alpa_job.inspect.render import _html_table, figure_html, page_html

    png = plot_png(data)
    figure = figure_html("runs compared", png) if png else "<p>no measurements to plot</p>"
    best = fastest(data)
    verdict = f"<p>Fastest step: <b>{html.escape(best)}</b></p>" if best else ""
    body = f"{_html_table(columns(data), table_rows(data), 'compare')}\n{verdict}\n<h2>Plots</h2>\n{figure}"
    return page_html("Runs compared", body, heading=f"Runs compared ({len(data)})")


def to_json(data: List[Dict[str, Any]]) -> str:
    return strict_json.dumps(data, indent=2)
