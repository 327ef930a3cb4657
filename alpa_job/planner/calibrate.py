"""`python -m alpa_job.planner.calibrate [--kernels-only]`: recompute the compiled blocks of every calibration and validation entry.

Each measured run is compiled the way a plan compiles a candidate, and what the plan reads is written beside
the measurement, so planning itself never recompiles them:
- `cpu`: on emulated CPU devices: FLOPs, traffic, XLA's memory analysis (estimate.py fits its constants to these);
- `kernels`, `memory_gpu` (where JAX's CUDA plugin is there, gpu_target.py): compiled for the entry's GPU, its
  kernels and collectives (kernel_cost.features) and XLA's memory analysis of the GPU program. An entry with
  `kernels_from` {archive, case} takes them from the program the GPU itself ran, saved with its profiled
  kernel times by the repository's GPU planner validation benchmark (run with --kernels), and `kernel_ms`
  (the measured kernel time of each kind), which kernel_estimate.py fits its constants to.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
import tarfile
from typing import Any, Dict, List, Optional

from alpa_job import strategies as strategy_records
from alpa_job.planner import estimate, gpu_target, kernel_cost, kernel_estimate
from alpa_job.planner.run_worker import compile_in_worker

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def request_for(entry: Dict[str, Any], target_gpu: Optional[str] = None) -> Dict[str, Any]:
    return {
        "preset": entry.get("preset"),
        "config": None,
        "devices": entry["nodes"] * entry["gpus_per_node"],
        "gpus_per_node": entry["gpus_per_node"],
        "candidates": [[entry["strategy"], entry["mesh"]]],
        "cli_values": {**plan_values(entry["batch_size"], entry.get("micro_batches", 0)), **entry.get("settings", {})},
        "target_gpu": target_gpu,
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


def _compiled(entry: Dict[str, Any], target_gpu: Optional[str], timeout_s: float) -> Dict[str, Any]:
    result = compile_in_worker(request_for(entry, target_gpu), timeout_s)
    row = result["candidates"][0]
    if "error" in row:
        raise SystemExit(f"{entry['id']}: {row['error']}")
    return {**row, "jax": result["jax"]}


def from_archive(source: Dict[str, str], devices: int, gpus_per_node: int) -> Dict[str, Any]:
    """{kernels, kernel_ms} of the program a GPU ran: its HLO and profiled kernel times from an archive the
    GPU planner validation benchmark saved (a path relative to the repository)."""
    with tarfile.open(os.path.join(REPO, source["archive"])) as tar:
        text = gzip.decompress(tar.extractfile(f"kernels/{source['case']}.hlo.txt.gz").read()).decode()
        times = json.load(tar.extractfile(f"kernels/{source['case']}.kernels.json"))
    costs = kernel_cost.Costs(text)
    measured = {"products": 0.0, "attention": 0.0, "memory": 0.0}
    for k in costs.kernels:
        kind = "attention" if k.kind == "attention" else "products" if k.kind in kernel_estimate.PRODUCTS else "memory"
        measured[kind] += times.get(k.name, {}).get("us", 0.0) / 1e3
    return {
        "kernels": kernel_cost.costed_features(costs, devices, gpus_per_node),
        "kernel_ms": {k: round(v, 3) for k, v in measured.items()},
    }


def features(entries: List[Dict[str, Any]], timeout_s: float = 900.0, for_gpu: bool = False, cpu: bool = True) -> None:
    for number, entry in enumerate(entries, 1):
        print(f"[calibrate] {number}/{len(entries)} {entry['id']}", file=sys.stderr, flush=True)
        if cpu or "cpu" not in entry:
            row = _compiled(entry, None, timeout_s)
            entry["cpu"] = {**cpu_features(row), "jax": row["jax"]}
        if not for_gpu or (entry["nodes"] > 1 and strategy_records.get(entry["strategy"]).pipelined):
            continue  # a pipelined step across hosts does not compile for the GPU in minutes (see README)
        if entry.get("kernels_from"):
            entry.update(from_archive(entry["kernels_from"], entry["nodes"] * entry["gpus_per_node"], entry["gpus_per_node"]))
        row = _compiled(entry, entry["gpu"], timeout_s)
        entry["memory_gpu"] = row["memory"]
        if not entry.get("kernels_from"):
            entry["kernels"] = row["kernels"]


_FLAT = re.compile(r'\[(?:[^\[\]{}"]|"[^"\n]*")*\n(?:[^\[\]{}"]|"[^"\n]*")*\]')  # a list of scalars, one a line


def dumps(data: Dict[str, Any]) -> str:
    """Indented JSON with each list of scalars on one line (a kernels block is thousands of short rows)."""
    text = json.dumps(data, indent=1)
    return _FLAT.sub(lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cpu = "--kernels-only" not in argv  # keep the cpu blocks that are there (the slow half)
    for_gpu = gpu_target.plugin() is not None
    if not for_gpu:
        print("no CUDA plugin: only the cpu blocks (for the kernels blocks: " + gpu_target.install_hint() + ")", file=sys.stderr)
    for path in (estimate.VALIDATION_PATH, estimate.CALIBRATION_PATH):  # the calibration last: it is fitted below
        with open(path) as f:
            data = json.load(f)
        features(data["entries"], for_gpu=for_gpu, cpu=cpu)
        with open(path, "w") as f:
            f.write(dumps(data))
    constants = estimate.fit(data)
    print(json.dumps(constants.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
