"""Where a profiled step's GPU time goes: kernel time per step by kind and the costliest HLO ops.

Reads the JAX profiler trace a `--profile START:COUNT` run wrote (RUN/profile/**/*.trace.json.gz) and
prints, per step and averaged over the devices, the busy kernel time, each kind's share (matmuls, NCCL,
copies and slices, other fusions) and the HLO ops that cost most. Two runs side by side (say `data` and
`pipeline` of one model) show what the slower one spends its extra time on.

    python3 bench/trace_top_ops.py RUN_DIR [RUN_DIR ...] [--steps 2] [--top 25]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections import defaultdict

import lib.checkout  # noqa: F401 - first: alpa_job from this checkout
from alpa_job.record import trace_summary

KINDS = (
    ("matmul", re.compile(r"gemm|cublas|cutlass|nvjet|sm90_xmma|sm100|cudnn|flash|fmha", re.I)),
    ("copy / slice / update", re.compile(r"copy|memcpy|memset|dynamic.update.slice|dynamic.slice|slice|concatenate", re.I)),
)


def kind_of(name: str, hlo_op: str) -> str:
    if trace_summary.collective_kind(hlo_op) or trace_summary.collective_kind(name):
        return "nccl"
    for kind, pattern in KINDS:
        if pattern.search(name) or pattern.search(hlo_op):
            return kind
    return "other fusion"


def device_kernels(path: str):
    """{device pid: [(name, hlo_op, dur_us)]} for the GPU timelines of one trace."""
    platform, by_device = trace_summary.timelines(trace_summary.load_events(path))
    if platform != "gpu":
        return {}
    return {
        pid: [(e.get("name", ""), str(e.get("args", {}).get("hlo_op", "")), float(e["dur"])) for e in events]
        for pid, events in by_device.items()
    }


def summarise(run_dir: str, steps: int, top: int) -> dict:
    traces = sorted(glob.glob(os.path.join(run_dir, "profile", "**", "*.trace.json.gz"), recursive=True))
    if not traces:
        raise SystemExit(f"{run_dir}: no profile/**/*.trace.json.gz (run the job with --profile START:COUNT)")
    per_kind, per_op, count = defaultdict(float), defaultdict(float), defaultdict(int)
    devices = 0
    for path in traces:
        for kernels in device_kernels(path).values():
            devices += 1
            for name, hlo_op, dur in kernels:
                kind = kind_of(name, hlo_op)
                per_kind[kind] += dur
                # The kernel's own name: an HLO op's inside a command buffer (CUDA graph), whose name says nothing
                key = (kind, name[:60] if hlo_op.startswith("command_buffer") or not hlo_op else hlo_op)
                per_op[key] += dur
                count[key] += 1
    scale = 1e3 * max(devices, 1) * steps  # us over devices and steps -> ms a step on one device
    busy = sum(per_kind.values()) / scale
    print(f"\n{run_dir}: {devices} device timeline(s), {busy:.1f} ms of kernels a step on a device")
    for kind, us in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:24s} {us / scale:8.2f} ms  {us / scale / busy:6.1%}")
    print(f"  {'costliest HLO ops':40s} {'ms/step':>8s} {'calls/step':>10s}")
    for (kind, op), us in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {op[:40]:40s} {us / scale:8.2f} {count[(kind, op)] / max(devices, 1) / steps:10.1f}  ({kind})")
    return {
        "run": run_dir,
        "devices": devices,
        "busy_ms_per_step": round(busy, 2),
        "kinds_ms": {k: round(v / scale, 2) for k, v in per_kind.items()},
        "top_ops": [
            {"op": op, "kind": kind, "ms": round(us / scale, 3), "calls": count[(kind, op)] / max(devices, 1) / steps}
            for (kind, op), us in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--steps", type=int, default=2, help="steps the trace holds (--profile START:COUNT's COUNT)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", default="", help="also write the summaries here")
    args = parser.parse_args()
    rows = [summarise(run, args.steps, args.top) for run in args.runs]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
