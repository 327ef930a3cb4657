"""Wall time of `python -m alpa_job train --model mlp --steps 20 --out DIR`, Ray start included.

Target (issue 2): under 3 minutes on a 2-core CPU machine. Runs the real CLI in a fresh process
each repeat (cold Ray start, cold JAX compile) and reports the phases from the run's report.
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
TARGET_S = 180.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--address", default="local", help="local (default, with Ray start) or none")
    args = parser.parse_args()
    rows, raw = [], []
    for i in range(args.repeats):
        out = tempfile.mkdtemp(prefix="bench-train-")
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "alpa_job", "train", "--model", "mlp", "--steps", "20", "--address", args.address, "--out", out],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"run {i} failed:\n{proc.stderr[-2000:]}")
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
        raw.append(
            {
                "wall_s": round(wall, 2),
                "compile_s": report["compile_seconds"],
                "loop_s": report["loop_seconds"],
                "step_time_s": report["step_time_s"],
                "throughput": report["throughput"],
                "compiles": report["compiles"],
            }
        )
        rows.append(
            [
                i,
                f"{wall:.1f}",
                report["compile_seconds"],
                report["loop_seconds"],
                f"{report['step_time_s'] * 1e3:.1f}",
                report["throughput"],
                "yes" if wall < TARGET_S else "NO",
            ]
        )
    table = print_table(("run", "wall s", "compile s", "loop s", "ms/step", "samples/s", f"< {TARGET_S:.0f} s"), rows)
    record(
        "train_cli",
        {"address": args.address, "runs": raw, "target_s": TARGET_S},
        table,
        f"train --model mlp --steps 20 (address {args.address})",
    )


if __name__ == "__main__":
    main()
