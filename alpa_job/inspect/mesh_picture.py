"""The mesh picture of the HTML report: the device grid, and for a chosen parameter which slice
of it each device holds; for an Alpa pipeline, stage -> mesh -> devices.

Computed here from the record's rows (mesh shape, each leaf's shape and `split_axes`), drawn as inline
SVG with a small script that switches the parameter -- no network, no extra files.
"""

from __future__ import annotations

import html
import json
from typing import Any, Dict, List, Optional, Sequence

from alpa_job.inspect.units import stage_blocks_text
from alpa_job.record.run_record import Leaf, RunRecord
from alpa_job import strict_json

CELL_W, CELL_H, GAP = 150, 64, 8


def device_slices(leaf: Leaf, mesh_shape: Sequence[int], mesh_axes: Sequence[str]) -> List[str]:
    """For each device of the mesh (row-major), the index ranges of `leaf` it holds, e.g. '[0:128, :]'."""
    sizes = dict(zip(mesh_axes, mesh_shape))
    coords = _coordinates(mesh_shape)
    out = []
    for coord in coords:
        at = dict(zip(mesh_axes, coord))
        parts = []
        for dim, length in enumerate(leaf.shape):
            axes = leaf.split_axes[dim] if dim < len(leaf.split_axes) else []
            axes = [a for a in axes if sizes.get(a, 1) > 1]
            if not axes:
                parts.append(":")
                continue
            chunks, index = 1, 0
            for a in axes:  # the first axis named is the major one (PartitionSpec order)
                index = index * sizes[a] + at[a]
                chunks *= sizes[a]
            step = length // chunks if chunks else length
            parts.append(f"{index * step}:{(index + 1) * step}")
        out.append("[" + ", ".join(parts) + "]" if parts else "scalar")
    return out


def _coordinates(shape: Sequence[int]) -> List[tuple]:
    coords = [()]
    for size in shape:
        coords = [c + (i,) for c in coords for i in range(size)]
    return coords


def _default_leaf(leaves: List[Leaf]) -> Optional[Leaf]:
    """The largest split parameter (else the largest parameter): the one most worth a look."""
    params = [r for r in leaves if r.path.startswith("params/")] or leaves
    if not params:
        return None
    split = [r for r in params if any(r.split_axes)]
    return max(split or params, key=lambda r: r.bytes)


STAGE_LABEL_W = 300


def _stage_labels(record: RunRecord, rows: int) -> List[str]:
    """Per mesh row of a pipelined run: "stage i: first..last block, process(es) p"; none otherwise."""
    pipeline = record.pipeline or {}
    stages = pipeline.get("layers") or []
    if len(stages) != rows:
        return []
    return [
        f"stage {row['stage']}: {stage_blocks_text(row)}, process(es) {','.join(map(str, row['processes']))}"
        if row["blocks"]
        else f"stage {row['stage']}"
        for row in stages
    ]


def jax_mesh_svg(record: RunRecord) -> str:
    """The device grid (rows: the first mesh axis, columns: the second) and a parameter chooser."""
    shape = list(record.mesh.shape) or [record.devices.count or 1]
    axes = list(record.mesh.axes) or ["data"]
    rows = shape[0]
    cols = shape[1] if len(shape) > 1 else 1
    leaves = [r for r in record.params if r.path.startswith("params/")]
    data = {r.path: {"shape": r.shape, "spec": r.spec, "strategy": r.strategy, "slices": device_slices(r, shape, axes)} for r in leaves}
    chosen = _default_leaf(leaves)
    first = data.get(chosen.path) if chosen else None
    stage_rows = _stage_labels(record, rows)  # a pipeline's rows are its stages: their blocks and processes
    width = cols * (CELL_W + GAP) + 60 + (STAGE_LABEL_W if stage_rows else 0)
    height = rows * (CELL_H + GAP) + 50
    cells = []
    for i, label in enumerate(stage_rows):
        x, y = 50 + cols * (CELL_W + GAP) + 4, 30 + i * (CELL_H + GAP) + CELL_H / 2
        cells.append(f'<text class="stage" x="{x}" y="{y}" font-size="12">{html.escape(label)}</text>')
    for i in range(rows):
        for j in range(cols):
            k = i * cols + j
            x, y = 50 + j * (CELL_W + GAP), 30 + i * (CELL_H + GAP)
            text = first["slices"][k] if first else ""
            cells.append(
                f'<g class="device"><rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" rx="6" '
                f'fill="#e8f0fa" stroke="#4c78a8"/><text x="{x + 8}" y="{y + 20}" font-size="12" '
                f'font-weight="600">device {k}</text><text class="slice" data-device="{k}" x="{x + 8}" y="{y + 44}" '
                f'font-size="12" font-family="monospace">{html.escape(text)}</text></g>'
            )
    row_label = (
        f'<text x="4" y="{30 + rows * (CELL_H + GAP) / 2}" font-size="12" transform="rotate(-90 12 '
        f'{30 + rows * (CELL_H + GAP) / 2})">{html.escape(axes[0])} ({rows})</text>'
    )
    col_label = f'<text x="50" y="18" font-size="12">{html.escape(axes[1] if len(axes) > 1 else "")} ({cols})</text>'
    options = "".join(
        f'<option value="{html.escape(p)}"{" selected" if chosen and p == chosen.path else ""}>'
        f"{html.escape(p)} {html.escape(str(v['shape']))} {html.escape(v['strategy'])}</option>"
        for p, v in data.items()
    )
    caption = _caption(first, chosen.path if chosen else None)
    return f"""<div class="mesh-picture" id="mesh-picture">
<label>parameter <select id="mesh-param">{options}</select></label>
<p id="mesh-caption">{html.escape(caption)}</p>
<svg id="mesh-svg" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img"
 aria-label="device mesh {html.escape("×".join(map(str, shape)))}">{row_label}{col_label}{"".join(cells)}</svg>
<script>
(function() {{
  const data = {strict_json.dumps(data)};
  const select = document.getElementById("mesh-param");
  function show(path) {{
    const leaf = data[path];
    if (!leaf) return;
    document.querySelectorAll("#mesh-svg text.slice").forEach(function(t) {{
      t.textContent = leaf.slices[Number(t.dataset.device)];
    }});
    document.getElementById("mesh-caption").textContent =
      path + " " + JSON.stringify(leaf.shape) + " spec " + leaf.spec + " (" + leaf.strategy + "): each device holds";
  }}
  select.addEventListener("change", function() {{ show(select.value); }});
}})();
</script>
</div>"""


def _caption(entry: Optional[Dict[str, Any]], path: Optional[str]) -> str:
    if not entry:
        return "no parameters recorded"
    return f"{path} {json.dumps(entry['shape'])} spec {entry['spec']} ({entry['strategy']}): each device holds"


def alpa_stages_svg(record: RunRecord) -> str:
    """Stage -> mesh -> devices: a box per pipeline stage holding its mesh's device grid (hosts x GPUs)."""
    meshes = {m.id: m for m in record.meshes}
    stages = record.stages or [None]
    boxes, x, offset, height = [], 10, 0, 0
    for st in stages:
        mesh = meshes.get(st.mesh) if st is not None and st.mesh is not None else (record.meshes[0] if record.meshes else None)
        shape = list(
            (st.submesh_shape if st is not None and st.submesh_shape else None) or (mesh.shape if mesh else record.mesh.shape) or [1, 1]
        )
        rows, cols = (shape[0], shape[1]) if len(shape) > 1 else (1, shape[0])  # a 1-D mesh: one row
        w, h = cols * 70 + 20, rows * 44 + 60
        height = max(height, h)
        label = f"stage {st.stage}" if st is not None else "whole step"
        mesh_label = f"mesh {mesh.id}" if mesh else "mesh"
        devices = []
        for i in range(rows):
            for j in range(cols):
                dx, dy = x + 10 + j * 70, 50 + i * 44
                devices.append(
                    f'<rect x="{dx}" y="{dy}" width="62" height="36" rx="4" fill="#e8f0fa" '
                    f'stroke="#4c78a8"/><text x="{dx + 6}" y="{dy + 22}" font-size="11">'
                    f"gpu {offset + i * cols + j}</text>"
                )
        layers = f" layers {st.layers}" if st is not None and st.layers else ""
        boxes.append(
            f'<g class="stage"><rect x="{x}" y="10" width="{w}" height="{h}" rx="8" fill="none" '
            f'stroke="#f58518" stroke-width="2"/><text x="{x + 8}" y="28" font-size="12" font-weight="600">'
            f"{html.escape(label)} → {html.escape(mesh_label)} ({'×'.join(map(str, shape))})"
            f"{html.escape(layers)}</text>{''.join(devices)}</g>"
        )
        x += w + 16
        offset += rows * cols
    return (
        f'<div class="mesh-picture" id="mesh-picture"><svg id="mesh-svg" xmlns="http://www.w3.org/2000/svg" '
        f'width="{x}" height="{height + 20}" role="img" aria-label="pipeline stages">{"".join(boxes)}</svg></div>'
    )


def mesh_picture(record: RunRecord) -> str:
    if record.engine == "alpa":
        return alpa_stages_svg(record)
    return jax_mesh_svg(record)
