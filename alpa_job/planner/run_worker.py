"""Start the plan's compiling process (worker.py) with N CPU devices and wait for it, bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

from alpa_job.cpu_devices import with_device_count
from alpa_job.errors import KitError


def compile_in_worker(request: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
    """The worker's result for `request` (its `devices` CPU devices); a KitError naming the fix on failure."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = with_device_count(request["devices"], env.get("XLA_FLAGS", ""))
    env["JAX_PLATFORMS"] = "cpu"
    # The worker imports this very alpa_job (a checkout beside an installed copy must not mix the two).
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="alpa-plan-") as tmp:
        req, out = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(req, "w") as f:
            json.dump(request, f)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "alpa_job.planner.worker", req, out], env=env, timeout=timeout_s, stdout=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise KitError(
                f"planning {request['devices']} devices took over {timeout_s:.0f} s; raise --timeout or plan fewer strategies (--strategy)"
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
