"""The doctor's result as people read it: a table (nodes, TCP matrix, checks), JSON, and the one-line summary."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from alpa_job.cluster.doctor.checks import gib
from alpa_job import strict_json

NODE_VERSION_COLUMNS = ("python", "ray", "jax", "jaxlib", "alpa")


def render_json(result: Mapping[str, Any]) -> str:
    return strict_json.dumps(result, indent=2, sort_keys=True, default=str)


def render_table(result: Mapping[str, Any]) -> str:
    lines = [
        "doctor: %s (cidr %s, head %s) in %.1f s: %s"
        % (
            result.get("address"),
            result.get("cluster_cidr"),
            result.get("head"),
            result.get("seconds", 0),
            "OK" if result.get("ok") else "FAILED",
        )
    ]
    if result.get("nodes"):
        lines += [""] + _nodes_table(result["nodes"])
    if result.get("matrix"):
        lines += ["", "TCP reachability (row: source, column: target)"] + _matrix_table(result["matrix"])
    if (result.get("network") or {}).get("links"):
        lines += ["", "Links, Gb/s (row: sender, column: receiver)"] + _links_table(result["network"]["links"])
    lines.append("")
    lines += [_check_line(c) for c in result.get("checks", [])]
    return "\n".join(lines)


def _nodes_table(nodes: Mapping[str, Mapping[str, Any]]) -> List[str]:
    header = ("node", "host", "shm", "gpus") + NODE_VERSION_COLUMNS
    rows = []
    for ip in sorted(nodes):
        n = nodes[ip]
        v = n.get("versions") or {}
        rows.append(
            (
                ip + (" (head)" if n.get("head") else ""),
                n.get("hostname") or "",
                gib(n["shm_bytes"]) if n.get("shm_bytes") else "-",
                str(n.get("gpus")),
                *(str(v.get(k) or "-") for k in NODE_VERSION_COLUMNS),
            )
        )
    return grid(header, rows)


def _matrix_table(matrix: Mapping[str, Mapping[str, Any]]) -> List[str]:
    ips = sorted(set(matrix) | {d for row in matrix.values() for d in row})
    rows = [(src,) + tuple(_matrix_cell(matrix.get(src, {}).get(dst), src == dst) for dst in ips) for src in ips]
    return grid(("source \\ target",) + tuple(ips), rows)


def _links_table(links: Sequence[Mapping[str, Any]]) -> List[str]:
    by_pair = {(r["src"], r["dst"]): r for r in links}
    ips = sorted({r["src"] for r in links} | {r["dst"] for r in links})

    def cell(src: str, dst: str) -> str:
        r = by_pair.get((src, dst))
        if src == dst or r is None:
            return "-"
        return "%.3g (%s ms)" % (r["gbps"], r["rtt_ms"]) if r["gbps"] is not None else "failed"

    return grid(("sender \\ receiver",) + tuple(ips), [(src,) + tuple(cell(src, dst) for dst in ips) for src in ips])


def _matrix_cell(cell: Optional[Mapping[str, Any]], diagonal: bool) -> str:
    if diagonal:
        return "-"
    if cell is None or cell.get("ok") is None:
        return "?"
    return "ok" if cell["ok"] else "blocked: " + ", ".join(cell["blocked"])


def _check_line(c: Mapping[str, Any]) -> str:
    mark = "ok  " if c["ok"] and not c.get("warn") else ("warn" if c["ok"] else "FAIL")
    return "%s %-9s %-12s %s%s" % (
        mark,
        c["name"],
        c["node"] or "*",
        c["detail"],
        "  -> fix: " + c["fix"] if not c["ok"] or c.get("warn") else "",
    )


def grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    widths = [max(len(str(r[i])) for r in [header] + list(rows)) for i in range(len(header))]
    fmt = "  ".join("%%-%ds" % w for w in widths)
    return [fmt % tuple(header), fmt % tuple("-" * w for w in widths)] + [fmt % tuple(r) for r in rows]


def failure_summary(result: Mapping[str, Any]) -> Optional[str]:
    """The one stderr line of a failed run: how many checks failed and the first one's fix; None if ok."""
    failed: List[Dict[str, Any]] = [c for c in result["checks"] if not c["ok"]]
    if result["ok"] or not failed:
        return None
    first = failed[0]
    return "doctor: %d check(s) failed; first: %s%s -> fix: %s" % (
        len(failed),
        "node %s: " % first["node"] if first["node"] else "",
        first["detail"],
        first["fix"],
    )
