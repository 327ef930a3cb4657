"""How much of a profiled step is communication: read from a JAX profiler trace (stdlib only).

On a GPU the trace has a timeline per device with every kernel; NCCL's kernels (or kernels of a
collective HLO op) are communication, the rest compute. Two shares of the traced window:
`comm_share` = the time any collective runs, `exposed_comm_share` = the time a collective runs while
no compute kernel does - what overlap failed to hide, and so what a faster layout could win back.
On CPU devices (no device timeline) the XLA ops on the executor threads stand in for kernels.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

_KINDS = (
    ("allgather", "all-gather"),
    ("all-gather", "all-gather"),
    ("reducescatter", "reduce-scatter"),
    ("reduce-scatter", "reduce-scatter"),
    ("allreduce", "all-reduce"),
    ("all-reduce", "all-reduce"),
    ("alltoall", "all-to-all"),
    ("all-to-all", "all-to-all"),
    ("sendrecv", "collective-permute"),
    ("collective-permute", "collective-permute"),
    ("broadcast", "broadcast"),
)
_HOST_RUNTIME = re.compile(r"::|^end: |^\$|Rendezvous|Wait for|Handle |^Pjit|Threadpool")

Interval = Tuple[float, float]


def collective_kind(name: str) -> Optional[str]:
    """The collective a kernel or HLO op name belongs to, or None for compute."""
    low = name.lower().replace("_", "")
    if "nccl" not in low and not any(low.startswith(k) for k, _ in _KINDS):
        return None
    for needle, kind in _KINDS:
        if needle in low:
            return kind
    return "other"


def _union(intervals: List[Interval]) -> List[Interval]:
    merged: List[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: List[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def _minus(a: List[Interval], b: List[Interval]) -> float:
    """Length of union(a) not covered by union(b) (both already merged and sorted)."""
    total, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                total += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            total += end - cursor
    return total


def timelines(events: List[Dict[str, Any]]) -> Tuple[str, Dict[Any, List[Dict[str, Any]]]]:
    """('gpu', {device pid: its kernel events}) or ('cpu', {host pid: XLA op events})."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in names.items() if name.startswith("/device:") and "CPU" not in name}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if devices:
        by_pid: Dict[Any, List[Dict[str, Any]]] = defaultdict(list)
        for e in spans:
            if e["pid"] in devices:
                by_pid[e["pid"]].append(e)
        return "gpu", dict(by_pid)
    ops = [
        e
        for e in spans
        if not _HOST_RUNTIME.search(e.get("name", ""))
        and (collective_kind(e.get("name", "")) or "fusion" in e.get("name", "") or "." in e.get("name", ""))
    ]
    return "cpu", {"host": ops}


def summarise_events(events: List[Dict[str, Any]], steps: int) -> Dict[str, Any]:
    platform, by_device = timelines(events)
    per_device = []
    by_kind: Dict[str, float] = defaultdict(float)
    for evs in by_device.values():
        if not evs:
            continue
        comm, compute = [], []
        for e in evs:
            interval = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            kind = collective_kind(str(e.get("args", {}).get("hlo_op", "")) or "") or collective_kind(e.get("name", ""))
            (comm if kind else compute).append(interval)
            if kind:
                by_kind[kind] += float(e["dur"])
        window = max(end for _, end in comm + compute) - min(start for start, _ in comm + compute)
        comm_u, compute_u = _union(comm), _union(compute)
        per_device.append((window, _length(comm_u), _minus(comm_u, compute_u)))
    if not per_device:
        return {"platform": platform, "devices": 0, "comm_share": None, "exposed_comm_share": None}
    n = len(per_device)
    window = sum(w for w, _, _ in per_device) / n
    return {
        "platform": platform,
        "devices": n,
        "traced_ms_per_step": round(window / 1e3 / max(steps, 1), 3),
        "comm_share": round(sum(c for _, c, _ in per_device) / n / window, 4) if window else None,
        "exposed_comm_share": round(sum(x for _, _, x in per_device) / n / window, 4) if window else None,
        # Kernel time a step, per device, of each collective kind (overlapped or not).
        "collective_ms_per_step": {k: round(v / 1e3 / n / max(steps, 1), 3) for k, v in sorted(by_kind.items())},
    }


def load_events(path: str) -> List[Dict[str, Any]]:
    """The events of a `.trace.json.gz` (JAX's profiler, Chrome trace format)."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarise_trace(path: str, steps: int) -> Dict[str, Any]:
    """The shares for a `.trace.json.gz` holding `steps` steps."""
    return summarise_events(load_events(path), steps)
