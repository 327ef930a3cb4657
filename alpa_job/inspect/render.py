"""Render a RunRecord as a terminal table, Markdown or a self-contained HTML page.

Reads the typed record (alpa_job.record.run_record); nothing here imports an engine.
"""

from __future__ import annotations

import base64
import html
import re
from typing import List, Optional, Sequence

from alpa_job.inspect.plots import all_plots
from alpa_job.record.run_record import InputRecord, MemoryRecord, RunRecord
from alpa_job.inspect.units import human_bytes, plan_title, stage_blocks_text
from alpa_job.record.startup import startup_text
from alpa_job import strict_json

PARAM_COLUMNS = ("path", "shape", "dtype", "bytes", "bytes_per_device", "spec", "mesh_ids", "strategy")


def _cell(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def network_text(network: dict) -> str:
    """One line: what a step sends across hosts (the network) and within one."""
    across = network["collectives_across_hosts"]
    return (
        f"{human_bytes(network['across_hosts_bytes'])} across hosts ({across} of {network['collectives']} "
        f"collectives cross, {network['hosts']} host(s)), {human_bytes(network['within_host_bytes'])} within a host"
        + ("" if network["groups_read"] else "; some replica groups unread: counted as spanning every device")
    )


def measured_network_text(record: RunRecord) -> str:
    """The start's all-reduce, then each process's NCCL transports where they differ and every problem."""
    m = record.network_measured
    text = (
        f"all-reduce of {human_bytes(m['bytes'])} a device over {m['devices']} {m['backend']} device(s): "
        f"{m['bus_gbps']} Gb/s bus bandwidth ({m['seconds'] * 1e3:.3g} ms)"
    )
    rows = [(p.id, p.nccl) for p in record.processes if p.nccl]
    lines = sorted({nccl["transports"] for _, nccl in rows})
    if lines:
        text += "; " + " | ".join(lines)
    problems = [f"process {pid}: {v}" for pid, nccl in rows for v in nccl["verdicts"]]
    return text + ("; " + "; ".join(problems) if problems else "")


def stragglers_text(stragglers: dict) -> str:
    """Who was slow and when (or that nobody was), then the slowest device's ratio at the end."""
    slow = [e for e in stragglers["events"] if e["event"] == "slow"]
    text = f"measured every {stragglers['every']} steps over {stragglers['window_steps']}-step windows: " + (
        "; ".join(
            f"process {e['process']} ({e['host']}{' ' + e['device'] if e.get('device') else ''}) "
            f"{e['what']} +{e['slower_by'] * 100:.0f}% at step {e['step']}"
            for e in slow
        )
        if slow
        else "no process slower than the others"
    )
    if stragglers["slow_now"]:
        text += "; still slow at the end: " + ", ".join(stragglers["slow_now"])
    latest = stragglers.get("latest")
    if latest and latest.get("work_ratio"):
        text += f"; slowest at the end x{max(latest['work_ratio']):.2f} the others' median"
    return text


def speed_text(timing: dict) -> str:
    """The steady step, tokens/s a device, TFLOP/s a device and MFU on both bases, naming the peaks and the
    FLOP count they use (MaxText's, causal attention at half, with the full count's beside it)."""
    steady = timing.get("steady_step") or {}
    if not steady.get("median_s"):
        return "-"
    parts = [f"steady step {steady['median_s'] * 1e3:.4g} ms"]
    if timing.get("tokens_per_s_per_device"):
        parts.append(f"{timing['tokens_per_s_per_device']:,.0f} tokens/s a device")
    parts += _rate_parts(timing, "")
    if timing.get("tflops_per_device") is not None:
        parts.append(_count_text(timing))
    return "; ".join(parts)


def _rate_parts(timing: dict, suffix: str) -> List[str]:
    """TFLOP/s a device and MFU on the measured and the datasheet peak, on the count `suffix` names."""
    parts = []
    if timing.get(f"tflops_per_device{suffix}") is not None:
        parts.append(f"{timing[f'tflops_per_device{suffix}']} TFLOP/s a device")
    peak = timing.get("peak") or {}
    for key, basis in ((f"mfu{suffix}", "measured_tflops"), (f"mfu_datasheet{suffix}", "datasheet_tflops")):
        if timing.get(key) is not None:
            parts.append(f"MFU {timing[key]:.2f} of {peak.get(basis)} TFLOP/s ({peak.get('precision')}, {basis.split('_')[0]})")
    return parts


def _count_text(timing: dict) -> str:
    """Which FLOP count the rates above use: MaxText's (then the full count's rates too), or the full one."""
    if timing.get("mfu_count") != "maxtext":
        return "FLOPs counted whole (no causal attention counted: api.Model.causal_attention)"
    return "FLOPs counted as MaxText does, causal attention at half; counted whole: " + ", ".join(_rate_parts(timing, "_full"))


def pipeline_text(pipeline: dict) -> str:
    """One line: the stages, which blocks each runs and on which processes, and the schedule's bubble."""
    where = "; ".join(
        f"stage {row['stage']}: {stage_blocks_text(row)} on process(es) {','.join(map(str, row['processes']))}"
        for row in pipeline["layers"]
    )
    return (
        f"{pipeline['stages']} stages x {pipeline['micro_batches']} micro-batches ({pipeline['schedule']}, bubble "
        f"{pipeline['bubble_fraction']:.0%}): {where}"
    )


def weight_gather_text(placed: dict) -> str:
    """`per layer (24 layers)` or `as XLA places them: <why>`."""
    if placed.get("placement") == "per layer":
        return f"per layer ({placed.get('layers', '?')} layers: each gathers its own before it runs and again in the backward)"
    return f"as XLA places them: {placed.get('reason') or 'XLA decides'}"


def summary_pairs(record: RunRecord) -> List[tuple]:
    s = record.summary
    pairs = [
        ("plan", plan_title(record)),
        ("engine / strategy", f"{record.engine} / {record.strategy}"),
        ("status", record.status if record.status == "ok" else f"{record.status}: {record.error}"),
        ("mesh", f"{'x'.join(map(str, record.mesh.shape))} {tuple(record.mesh.axes)}"),
        ("processes / hosts / devices", f"{s.processes} / {s.hosts} / {s.devices}"),
        ("compiles (train step)", record.compiles),
        ("compile seconds", record.compile_seconds),
    ]
    breakdown = (record.timing or {}).get("startup_breakdown")
    if breakdown:  # where the time to the first step went (record/startup.py)
        pairs.append(("start-up", startup_text(breakdown)))
    if record.compiler_options:  # beyond XLA_FLAGS: the strategy's own (engines/xla_options.py)
        pairs.append(
            (
                "XLA options (strategy's)",
                ", ".join(
                    f"{name}={human_bytes(value) if name.endswith('_bytes') else value}"
                    for name, value in sorted(record.compiler_options.items())
                ),
            )
        )
    if record.weight_gather:  # fsdp / hsdp: where the step gathers the split weights (--fsdp-gather)
        pairs.append(("weights gathered", weight_gather_text(record.weight_gather)))
    if record.network_traffic:
        pairs.append(("traffic per device per step", network_text(record.network_traffic)))
    if record.pipeline:
        pairs.append(("pipeline stages", pipeline_text(record.pipeline)))
    if record.network_measured:
        pairs.append(("network measured", measured_network_text(record)))
    if record.stragglers:
        pairs.append(("stragglers", stragglers_text(record.stragglers)))
    pairs += [
        ("steps", record.steps),
        ("samples seen / dropped", f"{record.samples_seen} / {record.samples_dropped}"),
        ("step time (s)", record.step_time_s),
        ("throughput (samples/s)", record.throughput),
        ("speed", speed_text(record.timing or {})),
        ("loss first -> last", f"{s.loss_first} -> {s.loss_last}"),
        ("state bytes total / per device", f"{human_bytes(s.state_bytes)} / {human_bytes(s.state_bytes_per_device)}"),
        ("strategy counts (params)", s.strategy_counts.get("params")),
        ("strategy counts (opt_state)", s.strategy_counts.get("opt_state")),
        ("memory", _memory_text(record.memory)),
    ]
    pairs += _eval_pairs(record)
    pairs += _profile_pairs(record)
    pairs += [("note", note) for note in record.notes]
    if record.source:
        pairs.append(("source", record.source))
    return [(k, _cell(v) if not isinstance(v, dict) else strict_json.dumps(v)) for k, v in pairs]


def _eval_pairs(record: RunRecord) -> List[tuple]:
    if not record.evals:  # a report from before eval points, or an engine's one number: no step, no perplexity
        return [] if record.eval_loss is None else [("eval loss", record.eval_loss)]
    point = record.evals[-1]
    ppl = f", perplexity {_cell(point.perplexity)}" if point.perplexity is not None else ""
    return [("eval loss (final)", f"{_cell(point.loss)}{ppl} at step {point.step} ({point.batches} batches)")]


def _profile_pairs(record: RunRecord) -> List[tuple]:
    """--profile's trace: where it is, and how much of the traced steps was communication."""
    profile = (record.timing or {}).get("profile")
    if not profile:
        return []
    first, last = profile.get("steps") or (None, None)
    pairs = [("profile (steps %s-%s)" % (first, last), profile.get("trace") or profile.get("dir"))]
    if profile.get("comm_share") is not None:
        kinds = ", ".join(f"{k} {v} ms" for k, v in (profile.get("collective_ms_per_step") or {}).items())
        pairs.append(
            (
                "communication share (profiled)",
                f"{profile['comm_share']:.1%} of the step, {profile['exposed_comm_share']:.1%} not "
                f"overlapped with compute ({profile.get('platform')}; per step: {kinds})",
            )
        )
    if profile.get("summary_error"):
        pairs.append(("communication share (profiled)", f"not read from the trace: {profile['summary_error']}"))
    return pairs


def _exact(n: int) -> str:
    """'31138512 B (29.7 MiB)': the exact count (what scripts grep) and the human one."""
    return f"{n} B ({human_bytes(n)})"


def _memory_text(memory: Optional[MemoryRecord]) -> str:
    if memory is None:
        return "not measured"
    parts = []
    if memory.peak_estimate_bytes is not None:
        parts.append(f"peak estimate {_exact(memory.peak_estimate_bytes)}/device")
    if memory.total_allocation_bytes is not None:
        parts.append(f"allocation {_exact(memory.total_allocation_bytes)}")
    if memory.stage_allocation_bytes:
        parts.append(f"per stage {', '.join(human_bytes(b) for b in memory.stage_allocation_bytes)}")
    return ", ".join(parts) or "not measured"


def input_pairs(record: RunRecord) -> List[tuple]:
    """What the input pipeline did, as (item, value) text; empty for a run with no input record
    (older reports, Alpa dump folders)."""
    inp = record.input
    if inp is None:
        return []
    pairs = [
        ("dataset", inp.dataset),
        ("pipeline", inp.pipeline or "-"),
        ("rows / steps per epoch", f"{inp.rows:,} / {inp.steps_per_epoch:,}"),
        ("epochs", _cell(inp.epochs)),
    ]
    pairs += _read_pairs(record, inp)
    # The rate and the wait are process 0's: the one whose result leads the record.
    whose = " (process 0)" if len(_read_shares(record)) > 1 else ""
    pairs.append(("read rate" + whose, f"{human_bytes(inp.bytes_per_s)}/s" if inp.bytes_per_s is not None else "-"))
    pairs.append(("data wait" + whose, _wait_text(inp)))
    return pairs


def _read_pairs(record: RunRecord, inp: InputRecord) -> List[tuple]:
    """Rows and bytes read: the run's one process, or process 0 and the sum over all processes (each
    reads only its own rows of every global batch, so the total is what the run read)."""
    mine = f"{inp.rows_read:,} rows, {_exact(inp.bytes_read)}"
    shares = _read_shares(record)
    if len(shares) < 2:
        return [("rows / bytes read", mine)]
    rows = sum(r for _p, r, _b in shares)
    size = sum(b for _p, _r, b in shares)
    return [("rows / bytes read (process 0)", mine), (f"rows / bytes read (all {len(shares)} processes)", f"{rows:,} rows, {_exact(size)}")]


def _read_shares(record: RunRecord) -> List[tuple]:
    """(process, rows, bytes) of every process that recorded its share."""
    return [(p, p.rows_read, p.bytes_read or 0) for p in record.processes if p.rows_read is not None]


def _wait_text(inp: InputRecord) -> str:
    """'0.287 ms per step, 0.05% of the loop (0.0086 s in all)': how long steps waited for their batch."""
    if inp.data_wait_per_step_s is None:
        return f"{_cell(inp.data_wait_s)} s in all"
    share = f", {inp.data_wait_fraction:.2%} of the loop" if inp.data_wait_fraction is not None else ""
    return f"{inp.data_wait_per_step_s * 1e3:.3g} ms per step{share} ({_cell(inp.data_wait_s)} s in all)"


def input_process_rows(record: RunRecord) -> List[List[str]]:
    """One row per process with its share of the input; none for a one-process run (the summary says it)."""
    shares = _read_shares(record)
    if len(shares) < 2:
        return []
    return [[_cell(p.id), p.host or _cell(p.ip), f"{rows:,}", _exact(size)] for p, rows, size in shares]


INPUT_PROCESS_HEADER = ("process", "host", "rows read", "bytes read")


def eval_rows(record: RunRecord) -> List[List[str]]:
    return [[_cell(e.step), _cell(e.loss), _cell(e.perplexity), _cell(e.batches)] for e in record.evals]


EVAL_HEADER = ("step", "eval loss", "perplexity", "batches")


def _collective_rows(record: RunRecord, fmt_bytes=None) -> List[List[str]]:
    fmt_bytes = fmt_bytes or _cell
    return [[kind, _cell(c.count), fmt_bytes(c.bytes)] for kind, c in (record.collectives or {}).items()]


def _search_rows(record: RunRecord) -> List[List[str]]:
    return [
        [
            r.strategy,
            _cell(r.mesh_shape),
            _cell(r.fits),
            _cell(r.peak_bytes_per_device),
            _cell(r.compile_s),
            _cell(r.step_time_s) + (" (predicted)" if r.predicted_from else ""),
            "yes" if r.chosen else "",
            r.note,
        ]
        for r in (record.search or [])
    ]


SEARCH_HEADER = ("strategy", "mesh", "fits", "peak B/device", "compile s", "step s", "chosen", "note")


def _process_rows(record: RunRecord) -> List[List[str]]:
    return [[_cell(p.id), p.host or "", _cell(p.ip), _cell(len(p.local_devices)), _cell(p.coordinator)] for p in record.processes]


PROCESS_HEADER = ("process", "host", "ip", "devices", "coordinator")


def _stage_rows(record: RunRecord) -> List[List[str]]:
    return [
        [
            _cell(st.stage),
            _cell(st.mesh),
            _cell(st.layers),
            _cell(st.submesh_shape),
            _cell(st.logical_shape),
            _cell(st.memory_bytes),
            _cell(st.memory_bytes_forward),
            _cell(st.memory_bytes_backward),
            _cell(sum(c.count for c in st.collectives.values()) if st.collectives else None),
        ]
        for st in record.stages
    ]


STAGE_HEADER = ("stage", "mesh", "layers", "submesh", "logical mesh", "memory B", "forward B", "backward B", "collectives")


def _param_rows(record: RunRecord) -> List[List[str]]:
    return [[_cell(getattr(r, c)) for c in PARAM_COLUMNS] for r in record.params]


# A terminal shows this many leaf rows at most: a large (mixture-of-experts) model has 10,000+ leaves, which
# no one reads on a terminal and which take a rich table seconds to lay out. JSON, Markdown and HTML keep them all.
TABLE_ROWS = 60
GROUPED_COLUMNS = ("leaves",) + PARAM_COLUMNS
_INDEX = re.compile(r"\d+(?=/|$)")


def leaf_pattern(path: str) -> str:
    """The path with each path component's trailing number as `*`: layer_3 / expert_12 / opt_state/0 -> *."""
    return _INDEX.sub("*", path)


def grouped_param_rows(record: RunRecord) -> List[List[str]]:
    """One row per group of leaves that differ only in their layer / expert / chain index (same shape, dtype,
    spec, meshes and strategy), first-seen order; `*` stands where the members' indices differ (an index all
    share stays), and bytes are the group's sums."""
    groups: dict = {}
    for r in record.params:
        key = (leaf_pattern(r.path), tuple(r.shape), r.dtype, r.spec, tuple(r.mesh_ids), r.strategy)
        g = groups.get(key)
        if g is None:
            groups[key] = g = [r, 0, 0, 0, [set() for _ in _INDEX.findall(r.path)]]
        g[1] += 1
        g[2] += r.bytes
        g[3] += r.bytes_per_device
        for seen, index in zip(g[4], _INDEX.findall(r.path)):
            seen.add(index)
    rows = []
    for first, count, size, per_device, indices in groups.values():
        shown = iter([next(iter(seen)) if len(seen) == 1 else "*" for seen in indices])
        path = _INDEX.sub(lambda _m: next(shown), first.path)
        rows.append(
            [
                f"{count:,}",
                path,
                _cell(first.shape),
                first.dtype,
                human_bytes(size),
                human_bytes(per_device),
                first.spec,
                _cell(first.mesh_ids),
                first.strategy,
            ]
        )
    return rows


def terminal_param_table(record: RunRecord, all_rows: bool = False) -> tuple:
    """(header, rows, note) of the terminal's parameter table: every leaf when they fit in TABLE_ROWS (or
    `all_rows`), else the leaves grouped across layers/experts, capped at TABLE_ROWS with a line saying how
    many more there are and where to see them all."""
    n = len(record.params)
    if all_rows or n <= TABLE_ROWS:
        return PARAM_COLUMNS, _param_rows(record), ""
    rows = grouped_param_rows(record)
    note = (
        f"{n:,} leaves in {len(rows):,} groups of leaves identical but for their layer/expert index "
        f"(* where they differ; bytes: the group's total)"
    )
    if len(rows) > TABLE_ROWS:
        hidden = sum(int(r[0].replace(",", "")) for r in rows[TABLE_ROWS:])
        note += f"; ... {len(rows) - TABLE_ROWS:,} more groups ({hidden:,} leaves) not shown"
        rows = rows[:TABLE_ROWS]
    return GROUPED_COLUMNS, rows, note + "; every leaf: --all-rows, or --format json|md|html"


# ----- Markdown ------------------------------------------------------------------------------------
def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(x: str) -> str:
        return str(x).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def to_markdown(record: RunRecord) -> str:
    parts = [f"# Parallel plan report: {record.config.get('model', '?')}", "", _md_table(("item", "value"), summary_pairs(record)), ""]
    if record.search:
        parts += ["## Auto search", "", _md_table(SEARCH_HEADER, _search_rows(record)), ""]
    parts += _input_markdown(record)
    if record.evals:
        parts += ["## Eval", "", _md_table(EVAL_HEADER, eval_rows(record)), ""]
    if record.processes:
        parts += ["## Processes", "", _md_table(PROCESS_HEADER, _process_rows(record)), ""]
    if record.stages:
        parts += ["## Pipeline stages", "", _md_table(STAGE_HEADER, _stage_rows(record)), ""]
    parts += ["## Collectives in the optimized HLO", "", _md_table(("kind", "count", "bytes"), _collective_rows(record)), ""]
    parts += ["## Parameters and optimizer state", "", _md_table(PARAM_COLUMNS, _param_rows(record)), ""]
    return "\n".join(parts)


def _input_markdown(record: RunRecord) -> List[str]:
    pairs = input_pairs(record)
    if not pairs:
        return []
    parts = ["## Input", "", _md_table(("item", "value"), pairs), ""]
    shares = input_process_rows(record)
    if shares:
        parts += ["Each process reads only its own rows of every global batch:", "", _md_table(INPUT_PROCESS_HEADER, shares), ""]
    return parts


# ----- terminal table ------------------------------------------------------------------------------
def to_table(record: RunRecord, all_rows: bool = False) -> str:
    """A plain-text rendering (rich when available; the legacy image may not have it). The parameter table is
    capped (terminal_param_table) unless `all_rows`; then it is plain aligned columns, which lay out 10,000
    rows in a fraction of the time a rich table takes."""
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
    param_header, param_rows, param_note = terminal_param_table(record, all_rows)
    full = all_rows and len(param_rows) > TABLE_ROWS
    tables = [
        (("item", "value"), input_pairs(record), "input"),
        (INPUT_PROCESS_HEADER, input_process_rows(record), "input per process"),
        (EVAL_HEADER, eval_rows(record), "eval"),
        (SEARCH_HEADER, _search_rows(record), "auto search"),
        (STAGE_HEADER, _stage_rows(record), "pipeline stages"),
        (param_header, [] if full else param_rows, "parameters and optimizer state"),
        (("kind", "count", "bytes"), _collective_rows(record), "collectives"),
    ]
    for header, rows, title in tables:
        if full and title == "parameters and optimizer state":
            continue
        if rows or title in ("parameters and optimizer state", "collectives"):
            t = Table(title=title)
            for h in header:  # a leaf's path is what the row is about: wrapped, never cut short
                t.add_column(h, overflow="fold" if h == "path" else "ellipsis")
            for row in rows:
                t.add_row(*row)
            console.print(t)
            if param_note and title.startswith("parameters"):
                console.print(param_note, markup=False, highlight=False, soft_wrap=True)
    text = console.export_text()
    if full:
        text += "\nparameters and optimizer state (%d leaves)\n%s\n" % (len(param_rows), _plain_columns(param_header, param_rows))
    return text


def _plain_columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in header]
    for row in rows:
        for i, c in enumerate(row):
            if len(c) > widths[i]:
                widths[i] = len(c)
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [list(header)] + list(rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class _NullFile:
    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


# ----- HTML ----------------------------------------------------------------------------------------
STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
table.params td:nth-child(8) { font-weight: 600; }
tr.opt td:first-child { padding-left: 2em; color: #555; }
figure { display: inline-block; margin: 0 1em 1em 0; }
figure img { max-width: 100%; }
.status-failed, .status-interrupted, .status-diverged { background: #fde2e1; border: 1px solid #e45756; padding: 0.6em 1em; }
.status-preempted { background: #fff4d6; border: 1px solid #e0a800; padding: 0.6em 1em; }
.bar { background: #4c78a8; height: 10px; display: inline-block; vertical-align: middle; }
.bar.over { background: #e45756; }
details summary { cursor: pointer; color: #4c78a8; }
.mesh-picture svg text { fill: #222; }
"""


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], css_class: str = "") -> str:
    return _raw_table(header, [[html.escape(str(c)) for c in row] for row in rows], css_class)


def _raw_table(header: Sequence[str], rows: Sequence[Sequence[str]], css_class: str = "") -> str:
    """Like _html_table, cells already HTML (the caller escaped them)."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return _table(header, body, css_class)


def _table(header: Sequence[str], body_html: str, css_class: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    return f'<table class="{css_class}"><thead><tr>{head}</tr></thead><tbody>{body_html}</tbody></table>'


def figure_html(caption: str, png: bytes) -> str:
    """A PNG inline; `dataset.rendered` lets the headless-browser test see that it decoded."""
    return (
        f'<figure><img alt="{html.escape(caption)}" onload="this.dataset.rendered=this.naturalWidth" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def page_html(title: str, body: str, heading: Optional[str] = None) -> str:
    """The report's page around `body` (the report and the run comparison share it); `heading` defaults to the title."""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body><h1>{html.escape(heading or title)}</h1>
{body}
</body></html>
"""


FOLDED_HEADER = ("path", "shape", "dtype", "bytes", "per device", "spec", "mesh", "strategy", "optimizer state")


def _folded_params_html(record: RunRecord) -> str:
    """One row per parameter with its optimizer state (Adam's mu/nu ...) folded under it: the state's rows
    follow their parameter, hidden until its toggle opens them; state of no parameter (step, count) last."""
    params = [r for r in record.params if r.path.startswith("params/")]
    others = [r for r in record.params if not r.path.startswith("params/")]
    # every "/"-suffix of every state path -> those paths, so a parameter finds its state in one look-up
    # (its path after "params/" is such a suffix), not by a scan of all state (10,000 leaves: 22 M compares)
    by_tail: dict = {}
    for o in others:
        parts = o.path.split("/")
        for i in range(1, len(parts)):
            by_tail.setdefault("/".join(parts[i:]), []).append(o)
    used = set()
    body = []
    for n, p in enumerate(params):
        mine = by_tail.get(p.path[len("params/") :], [])
        used.update(id(o) for o in mine)
        toggle = ""
        if mine:
            total = sum(o.bytes_per_device for o in mine)
            toggle = (
                f'<details data-group="g{n}" ontoggle="foldState(this)"><summary>{len(mine)} arrays, '
                f"{human_bytes(total)}/device</summary></details>"
            )
        body.append('<tr class="param">' + "".join(f"<td>{c}</td>" for c in _leaf_cells(p) + [toggle]) + "</tr>")
        for o in mine:
            body.append(f'<tr class="opt g{n}" hidden>' + "".join(f"<td>{c}</td>" for c in _leaf_cells(o) + [""]) + "</tr>")
    for o in others:
        if id(o) not in used:
            body.append('<tr class="other">' + "".join(f"<td>{c}</td>" for c in _leaf_cells(o) + [""]) + "</tr>")
    script = (
        "<script>function foldState(d){document.querySelectorAll('tr.'+d.dataset.group).forEach(function(r){r.hidden=!d.open;});}</script>"
    )
    return _table(FOLDED_HEADER, "".join(body), "params") + script


def _leaf_cells(r) -> List[str]:
    return [
        html.escape(r.path),
        html.escape(_cell(r.shape)),
        html.escape(r.dtype),
        human_bytes(r.bytes),
        human_bytes(r.bytes_per_device),
        html.escape(r.spec),
        html.escape(_cell(r.mesh_ids)),
        html.escape(r.strategy),
    ]


def device_budget(record: RunRecord) -> Optional[int]:
    """Bytes one device may use: --memory-limit-gb, else the size in the device kind ('H100 80GB')."""
    limit = (record.config or {}).get("memory_limit_gb")
    if limit:
        return int(float(limit) * 1e9)
    match = re.search(r"(\d+)\s*GB", record.devices.kind or "")
    return int(match.group(1)) * 10**9 if match else None


MEMORY_ROWS = (
    ("argument_size_in_bytes", "arguments (state + batch)"),
    ("output_size_in_bytes", "outputs"),
    ("alias_size_in_bytes", "aliased (donated) outputs"),
    ("temp_size_in_bytes", "temporaries"),
    ("generated_code_size_in_bytes", "generated code"),
    ("peak_estimate_bytes", "peak estimate"),
    ("total_allocation_bytes", "total allocation"),
)


def _memory_html(record: RunRecord) -> str:
    memory = record.memory
    if memory is None:
        return "<p>not measured</p>"
    budget = device_budget(record)
    values = [(label, getattr(memory, key)) for key, label in MEMORY_ROWS if getattr(memory, key) is not None]
    values += [(f"stage {i}", b) for i, b in enumerate(memory.stage_allocation_bytes or [])]
    scale = budget or max((v for _l, v in values), default=1) or 1
    rows = []
    for label, value in values:
        share = value / scale
        over = " over" if budget and value > budget else ""
        bar = f'<span class="bar{over}" style="width:{min(share, 1) * 300:.0f}px"></span>'
        rows.append([html.escape(label), human_bytes(value), f"{share:.1%}" if budget else "", bar])
    source = "--memory-limit-gb" if (record.config or {}).get("memory_limit_gb") else record.devices.kind or ""
    where = (
        f"device budget {human_bytes(budget)} ({html.escape(source)})"
        if budget
        else f"no device budget known ({html.escape(record.devices.kind or 'device')}); bars relative to the largest value"
    )
    return f"<p>XLA's memory analysis of the compiled step, per device; {where}.</p>" + _raw_table(
        ("what", "bytes", "of budget", ""), rows, "memory"
    )


def _dict_rows(data: dict) -> List[List[str]]:
    return [[str(k), _cell(v) if not isinstance(v, dict) else strict_json.dumps(v)] for k, v in data.items()]


def _input_html(record: RunRecord) -> List[str]:
    pairs = input_pairs(record)
    if not pairs:
        return []
    parts = ["<h2>Input</h2>", _html_table(("item", "value"), pairs, "input")]
    shares = input_process_rows(record)
    if shares:
        parts += [
            "<p>Each process reads only its own rows of every global batch:</p>",
            _html_table(INPUT_PROCESS_HEADER, shares, "input-processes"),
        ]
    return parts


def _eval_html(record: RunRecord) -> List[str]:
    if not record.evals:
        return []
    return ["<h2>Eval</h2>", _html_table(EVAL_HEADER, eval_rows(record), "evals")]


def to_html(record: RunRecord, rendered_plots: Optional[Sequence[tuple]] = None) -> str:
    from alpa_job.inspect.mesh_picture import mesh_picture

    if rendered_plots is None:
        rendered_plots = all_plots(record)
    figures = "".join(figure_html(caption, png) for _name, caption, png in rendered_plots)
    sections = []
    if record.status != "ok":
        sections.append(
            f'<p class="status-{html.escape(record.status)}"><b>{html.escape(record.status)}</b> after '
            f"{record.steps} step(s): {html.escape(record.error or '')}</p>"
        )
    sections += [
        "<h2>Summary</h2>",
        _html_table(("item", "value"), summary_pairs(record), "summary"),
        "<h2>Mesh</h2>",
        mesh_picture(record),
        "<h2>Memory per device</h2>",
        _memory_html(record),
        *_input_html(record),
        *_eval_html(record),
        "<h2>Plots</h2>",
        figures or "<p>no plots</p>",
    ]
    if record.search:
        chosen = next((r for r in record.search if r.chosen), None)
        why = ""
        if chosen:
            fitting = [r for r in record.search if r.step_time_s]
            how = (
                f" predicted from copies of the model with {' and '.join(map(str, chosen.predicted_from))} layers, then compiled whole"
                if chosen.predicted_from
                else ""
            )
            why = (
                f"<p>Chosen: <b>{html.escape(chosen.strategy)} {html.escape(_cell(chosen.mesh_shape))}</b>, the "
                f"fastest of {len(fitting)} candidate(s) that fit ({len(record.search) - len(fitting)} skipped or "
                f"did not fit){how}.</p>"
            )
        sections += ["<h2>Auto search</h2>", why, _html_table(SEARCH_HEADER, _search_rows(record), "search")]
    if record.processes:
        sections += ["<h2>Processes</h2>", _html_table(PROCESS_HEADER, _process_rows(record), "processes")]
    if record.stages:
        sections += ["<h2>Pipeline stages</h2>", _html_table(STAGE_HEADER, _stage_rows(record), "stages")]
    sections += [
        "<h2>Collectives in the optimized HLO</h2>",
        _html_table(("kind", "count", "bytes"), _collective_rows(record, human_bytes), "collectives"),
        "<h2>Parameters (optimizer state folded under each)</h2>",
        _folded_params_html(record),
    ]
    if record.config:
        sections += ["<h2>Config</h2>", _html_table(("setting", "value"), _dict_rows(record.config), "config")]
    if record.versions:
        sections += ["<h2>Versions</h2>", _html_table(("package", "version"), _dict_rows(record.versions), "versions")]
    return page_html(f"{record.config.get('model', '?')}: {plan_title(record)}", "".join(sections))
