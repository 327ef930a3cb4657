"""The plan as a ranked terminal table and as plan.html (the table, the assumptions, the best plan's mesh)."""

from __future__ import annotations

import html
from typing import List

from alpa_job import strategies as strategy_records
from alpa_job.inspect.mesh_picture import jax_mesh_svg
from alpa_job.record.plan_record import PlanCandidate, PlanRecord
from alpa_job.record.run_record import DeviceInfo, MeshShape, RunRecord

COLUMNS = (
    "rank",
    "strategy",
    "mesh",
    "fits",
    "state GB/GPU",
    "peak GB/GPU",
    "NVLink GB",
    "network GB",
    "compute ms",
    "comm ms",
    "step ms",
    "mostly",
    "note",
)


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def cells(row: PlanCandidate) -> List[str]:
    return [
        str(row.rank or "-"),
        row.strategy,
        "x".join(map(str, row.mesh_shape)),
        {True: "yes", False: "no", None: "-"}[row.fits],
        _gb(row.state_bytes_per_device),
        _gb(row.gpu_peak_bytes),
        _gb(row.nvlink_bytes),
        _gb(row.network_bytes),
        _ms(row.compute_s),
        _ms(row.communication_s),
        _ms(row.step_s),
        row.dominant or "-",
        row.note,
    ]


def ordered(record: PlanRecord) -> List[PlanCandidate]:
    return sorted(record.candidates, key=lambda r: (r.rank is None, r.rank or 0, r.step_s is None, r.step_s or 0))


def headline(record: PlanRecord) -> str:
    c = record.cluster
    where = f"{c.nodes} node(s) x {c.gpus_per_node} {c.gpu.name} = {c.devices} GPUs"
    if record.best is None:
        return f"plan for {record.model} on {where}: no candidate fits a GPU's {c.usable_bytes_per_device / 1e9:.1f} GB"
    best = record.candidates[record.best]
    return (
        f"plan for {record.model} on {where}: best {best.strategy} on mesh {tuple(best.mesh_shape)}, "
        f"~{best.step_s * 1e3:.1f} ms a step (estimated), {_gb(best.gpu_peak_bytes)} GB a GPU"
    )


def to_table(record: PlanRecord) -> str:
    rows = [list(COLUMNS)] + [cells(r) for r in ordered(record)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + ("  " + r[-1] if r[-1] else "") for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([headline(record), ""] + lines + [""] + [f"- {a}" for a in record.assumptions])


def to_html(record: PlanRecord) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join(
        "<tr{}>{}</tr>".format(' class="best"' if r.rank == 1 else "", "".join(f"<td>{html.escape(c)}</td>" for c in cells(r)))
        for r in ordered(record)
    )
    picture = ""
    if record.best is not None:
        best = record.candidates[record.best]
        axes_names = list(strategy_records.get(best.strategy).mesh_axes)
        run = RunRecord(
            engine="jax",
            strategy=best.strategy,
            mesh=MeshShape(best.mesh_shape, axes_names),
            params=best.params,
            devices=DeviceInfo(count=record.cluster.devices),
        )
        axes = "; ".join(f"{k}: {v}" for k, v in best.axes.items())
        picture = (
            f"<h2>Mesh of the best plan: {html.escape(best.strategy)} {html.escape(str(tuple(best.mesh_shape)))}"
            f"</h2><p>{html.escape(axes)}. Devices are numbered node-major: node k holds devices "
            f"{record.cluster.gpus_per_node}k .. {record.cluster.gpus_per_node}k+"
            f"{record.cluster.gpus_per_node - 1}.</p>{jax_mesh_svg(run)}"
        )
    assumptions = "".join(f"<li>{html.escape(a)}</li>" for a in record.assumptions)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>plan: {html.escape(record.model)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:nth-child(2),td:last-child{{text-align:left}}
tr.best{{background:#e8f5e9}}</style></head><body>
<h1>{html.escape(headline(record))}</h1>
<p>Bytes are per GPU per step; NVLink = inside a node, network = across nodes. Times are estimates.</p>
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
<h2>Assumptions</h2><ul>{assumptions}</ul>
{picture}
</body></html>
"""
