"""`python -m alpa_job.planner.calibrate`: recompute the `cpu` block of every calibration and validation entry.

Each measured run is compiled the way a plan compiles a candidate (on emulated CPU devices, one
worker process per device count), and its FLOPs, traffic and XLA memory analysis are written beside
the measurement, so planning itself never recompiles them. estimate.py fits its constants to these.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List

from alpa_job.planner import estimate
from alpa_job.planner.run_worker import compile_in_worker


def request_for(entry: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "preset": entry["preset"],
        "config": None,
        "devices": entry["nodes"] * entry["gpus_per_node"],
        "gpus_per_node": entry["gpus_per_node"],
        "candidates": [[entry["strategy"], entry["mesh"]]],
        "cli_values": plan_values(entry["batch_size"], entry.get("micro_batches", 0)),
    }


def plan_values(batch_size: int, micro_batches: int = 0) -> Dict[str, Any]:
    """The settings a plan forces: generated data of one batch (only its shape matters), no compile cache."""
    values = {"batch_size": batch_size, "num_samples": batch_size, "dataset": "synthetic", "compile_cache": "none"}
    return {**values, "micro_batches": micro_batches} if micro_batches else values


def cpu_features(row: Dict[str, Any]) -> Dict[str, Any]:
    """The part of a compiled candidate the fit reads."""
    memory = row["memory"] or {}
    return {
        "flops_per_step": row["flops_per_step"],
        "state_bytes_per_device": row["state_bytes_per_device"],
        "memory": memory,
        "collectives": row["collectives"],
    }


def features(entries: List[Dict[str, Any]], timeout_s: float = 900.0) -> None:
    for entry in entries:
        result = compile_in_worker(request_for(entry), timeout_s)
        row = result["candidates"][0]
        if "error" in row:
            raise SystemExit(f"{entry['id']}: {row['error']}")
        entry["cpu"] = {**cpu_features(row), "jax": result["jax"]}


def main(argv=None) -> int:
    for path in (estimate.VALIDATION_PATH, estimate.CALIBRATION_PATH):  # the calibration last: it is fitted below
        with open(path) as f:
            data = json.load(f)
        features(data["entries"])
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    constants = estimate.fit(data)
    print(json.dumps(constants.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
