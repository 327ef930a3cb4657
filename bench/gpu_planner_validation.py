"""Measured step time and peak memory of runs the planner was not calibrated on, for its validation table.

Each case is one `python -m alpa_job train --address none` on the first N GPUs of this machine (a small GPT,
the ResNet-50 and LLaMA examples, ...). Prints one table and saves OUT/gpu_planner_validation-<UTC>.json; the
planner's prediction for each case comes from `python -m alpa_job plan` with the same model settings, batch and
GPU count (on any machine), and RESULTS.md sets the two side by side.

    python3 bench/gpu_planner_validation.py [--cases NAME ...] [--steps 30] [--timeout 170]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from lib.checkout import REPO
from lib.results import save_result

EXAMPLES = [os.path.join(str(REPO), "examples", name) for name in ("resnet", "llama")]

# name: (GPUs, train flags). Batches are global; the planner is asked for the same ones.
CASES = {
    "gpt-small-1": (1, ["--preset", "gpt-small", "--strategy", "data"]),
    "gpt-small-2": (2, ["--preset", "gpt-small", "--strategy", "data"]),
    "resnet50-1": (1, ["--model", "resnet_example.model:build", "--batch-size", "256", "--strategy", "data"]),
    "resnet50-2": (2, ["--model", "resnet_example.model:build", "--batch-size", "256", "--strategy", "data"]),
    "llama1b-1": (1, ["--preset", "llama3.2-1b", "--seq-len", "2048", "--batch-size", "8", "--strategy", "data"]),
    "llama1b-2-fsdp": (2, ["--preset", "llama3.2-1b", "--seq-len", "2048", "--batch-size", "8", "--strategy", "fsdp"]),
    "gpt12l-2-tensor": (2, ["--preset", "gpt-12l", "--strategy", "tensor"]),
    "gpt12l-2-data": (2, ["--preset", "gpt-12l", "--strategy", "data"]),
    "gpt12l-2-fsdp": (2, ["--preset", "gpt-12l", "--strategy", "fsdp"]),
    "gpt-small-2-fsdp": (2, ["--preset", "gpt-small", "--strategy", "fsdp"]),
    "resnet50-2-fsdp": (2, ["--model", "resnet_example.model:build", "--batch-size", "256", "--strategy", "fsdp"]),
    "llama1b-2-data": (2, ["--preset", "llama3.2-1b", "--seq-len", "2048", "--batch-size", "8", "--strategy", "data"]),
}


def find(tree, key):
    """The first value under `key` anywhere in a JSON tree."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            found = find(item, key)
            if found is not None:
                return found
    return None


def run_case(name: str, gpus: int, flags, steps: int, timeout_s: float, scratch: str) -> dict:
    out = os.path.join(scratch, name)
    argv = [sys.executable, "-m", "alpa_job", "train", "--address", "none", "--steps", str(steps), "--compile-cache", "none"]
    argv += ["--quiet", "--no-tensorboard", "--out", out, *flags]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, range(gpus))))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *EXAMPLES, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-600:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", ""
    row = {"case": name, "gpus": gpus, "flags": flags, "rc": rc, "wall_s": round(time.perf_counter() - start, 1)}
    try:
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return {**row, "error": tail}
    steady = find(report, "steady_step") or {}
    row["step_ms"] = round(steady["median_s"] * 1e3, 3) if steady.get("median_s") else None
    for key, field in (("peak_gb", "peak_memory_bytes"), ("estimate_gb", "peak_estimate_bytes")):
        value = find(report, field)
        row[key] = round(value / 1e9, 3) if value else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=170.0, help="seconds a case")
    parser.add_argument("--scratch", default="/tmp/planner-validation")
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(str(REPO), "bench", "results")))
    args = parser.parse_args()
    rows = []
    for name in args.cases:
        gpus, flags = CASES[name]
        rows.append(run_case(name, gpus, flags, args.steps, args.timeout, args.scratch))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| case | GPUs | step ms | peak GB | XLA's estimate GB | wall s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['gpus']} | {r.get('step_ms')} | {r.get('peak_gb')} | {r.get('estimate_gb')} | {r['wall_s']} |")
    print("saved", save_result("gpu_planner_validation", args.out, {"steps": args.steps, "cases": rows}))


if __name__ == "__main__":
    main()
