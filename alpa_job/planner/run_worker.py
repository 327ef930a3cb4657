"""Start the plan's compiling processes (worker.py) with N CPU devices and wait for them, bounded.

XLA compiles one program on one core, so the candidates are dealt round-robin to as many worker processes as
there are cores (at most MAX_WORKERS: each holds its own copy of the model's abstract state and of XLA's
compile), which run side by side; their rows come back in the candidates' order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from alpa_job.cpu_devices import with_device_count
from alpa_job.errors import KitError

MAX_WORKERS = 4


def worker_count(candidates: int) -> int:
    return max(1, min(candidates, os.cpu_count() or 1, MAX_WORKERS))


def compile_in_worker(request: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
    """The workers' result for `request` (its `devices` CPU devices): {candidates (in the request's order),
    jax, target_gpu}; a KitError naming the fix on failure."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = with_device_count(request["devices"], env.get("XLA_FLAGS", ""))
    env["JAX_PLATFORMS"] = "cpu"
    # The workers import this very alpa_job (a checkout beside an installed copy must not mix the two).
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    candidates = request["candidates"]
    count = worker_count(len(candidates))
    numbers = [list(range(w, len(candidates), count)) for w in range(count)]  # each worker's candidates
    with tempfile.TemporaryDirectory(prefix="alpa-plan-") as tmp:
        running = []
        for w, mine in enumerate(numbers):
            req, out = os.path.join(tmp, f"request-{w}.json"), os.path.join(tmp, f"result-{w}.json")
            part = {**request, "candidates": [candidates[i] for i in mine], "numbers": [i + 1 for i in mine], "of": len(candidates)}
            with open(req, "w") as f:
                json.dump(part, f)
            argv = [sys.executable, "-m", "alpa_job.planner.worker", req, out]
            running.append((subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL), out))
        deadline = time.monotonic() + timeout_s
        try:
            results = [_wait(proc, out, deadline, request) for proc, out in running]
        except BaseException:  # a failed worker, the timeout, or Ctrl-C: none of them keeps compiling
            for proc, _ in running:
                proc.kill()
                proc.wait()
            raise
    rows: List[Dict[str, Any]] = [{}] * len(candidates)
    for mine, result in zip(numbers, results):
        for i, row in zip(mine, result["candidates"]):
            rows[i] = row
    return {**results[0], "candidates": rows}


def _wait(proc, out: str, deadline: float, request: Dict[str, Any]) -> Dict[str, Any]:
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        raise KitError(
            f"planning {request['devices']} devices took over the --timeout; raise --timeout or plan fewer strategies (--strategy)"
        ) from None
    if not os.path.exists(out):
        raise KitError(
            f"the plan's compiling process ended (exit {proc.returncode}) without a result, "
            "probably out of memory for this many devices; plan fewer devices or free RAM"
        )
    with open(out) as f:
        result = json.load(f)
    if "error" in result:
        raise KitError(result["error"])
    return result


def compiled_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    return list(result["candidates"])
