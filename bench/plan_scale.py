"""How long `python -m alpa_job plan` takes for GPT 24L on 64 devices (8 nodes x 8) and 512 (64 x 8).

Runs the real command (one worker process compiling every candidate on N emulated CPU devices), times the
whole command, and reads each candidate's compile time and the ranking from its plan.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from lib.results import record
from lib.table import print_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plan(nodes: int, gpus_per_node: int, preset: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "alpa_job",
                "plan",
                "--preset",
                preset,
                "--nodes",
                str(nodes),
                "--gpus-per-node",
                str(gpus_per_node),
                "--out",
                out,
                "--timeout",
                str(timeout),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout + 60,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            return {"devices": nodes * gpus_per_node, "wall_s": round(wall, 1), "error": proc.stderr.strip()[-500:]}
        data = json.load(open(os.path.join(out, "plan.json")))
    rows = data["candidates"]
    best = rows[data["best"]] if data["best"] is not None else None
    return {
        "devices": nodes * gpus_per_node,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "wall_s": round(wall, 1),
        "candidates": len(rows),
        "compile_s": [r["compile_s"] for r in rows],
        "max_compile_s": max(r["compile_s"] or 0 for r in rows),
        "best": f"{best['strategy']} {tuple(best['mesh_shape'])}" if best else None,
        "best_step_ms": round(best["step_s"] * 1e3, 1) if best else None,
        "table": [
            [r["strategy"], r["mesh_shape"], r["fits"], r["gpu_peak_bytes"], r["nvlink_bytes"], r["network_bytes"], r["step_s"]]
            for r in rows
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="gpt-24l")
    p.add_argument("--sizes", nargs="+", default=["8x8", "64x8"], help="NODESxGPUS")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args()
    results = []
    for size in args.sizes:
        nodes, gpus = (int(x) for x in size.split("x"))
        results.append(plan(nodes, gpus, args.preset, args.timeout))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "table"}), flush=True)
    header = ["devices", "nodes x gpus", "candidates", "wall s", "slowest compile s", "best", "best step ms", "<= 180 s"]
    rows = [
        [
            r["devices"],
            f"{r.get('nodes')}x{r.get('gpus_per_node')}",
            r.get("candidates", "-"),
            r["wall_s"],
            r.get("max_compile_s", "-"),
            r.get("best") or r.get("error", "-"),
            r.get("best_step_ms", "-"),
            "yes" if r["wall_s"] <= 180 else "no",
        ]
        for r in results
    ]
    table = print_table(header, rows)
    record(
        "plan_scale",
        {"preset": args.preset, "runs": results},
        table,
        f"plan {args.preset}: wall time of `python -m alpa_job plan` by device count",
    )


if __name__ == "__main__":
    main()
