"""Measured step time and peak memory of runs the planner was not calibrated on, for its validation table.

Each case is one `python -m alpa_job train --address none` on the first N GPUs of this machine (a small GPT,
the ResNet-50 and LLaMA examples, ...). Prints one table and saves OUT/gpu_planner_validation-<UTC>.json; the
planner's prediction for each case comes from `python -m alpa_job plan` with the same model settings, batch and
GPU count (on any machine), and RESULTS.md sets the two side by side.

    python3 bench/gpu_planner_validation.py [--cases NAME ...] [--steps 30] [--timeout 170] [--kernels]

--kernels also profiles steps 20-22 of each case and dumps its compiled step (XLA_FLAGS --xla_dump_to), and
saves OUT/kernels-<UTC>.tar.gz: per case the optimized HLO the GPU ran and each HLO op's kernel time a step
(device 0): what `python -m alpa_job.planner.calibrate` reads for a calibration entry's `kernels_from`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import subprocess
import sys
import tarfile
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
    # The planner's calibration runs' model (GPT 24L), for the per-kernel comparison: not validation rows.
    "gpt24l-1-data": (1, ["--preset", "gpt-24l", "--batch-size", "8", "--strategy", "data"]),
    "gpt24l-2-fsdp": (2, ["--preset", "gpt-24l", "--batch-size", "16", "--strategy", "fsdp"]),
    # fsdp's weights gathered per layer against XLA's placement, at the same batch; no flag: auto (XLA's where it fits).
    **{
        f"gpt24l-2-fsdp-{mode}": (2, ["--preset", "gpt-24l", "--batch-size", "16", "--strategy", "fsdp", "--fsdp-gather", mode])
        for mode in ("layer", "xla")
    },
    **{
        f"llama7b-2-fsdp-b{b}{suffix}": (2, ["--preset", "llama2-7b", "--batch-size", str(b), "--strategy", "fsdp", *flags])
        for b in (4, 6)
        for suffix, flags in (("", []), ("-layer", ["--fsdp-gather", "layer"]), ("-xla", ["--fsdp-gather", "xla"]))
    },
    # One host's pipeline against data at the same global batch (the target: pipeline >= 0.85 of data's speed).
    "gpt24l-2-data-b32": (2, ["--preset", "gpt-24l", "--batch-size", "32", "--strategy", "data"]),
    "gpt24l-2-pipeline-b32": (2, ["--preset", "gpt-24l", "--batch-size", "32", "--strategy", "pipeline", "--micro-batches", "8"]),
    **{
        f"gpt24l-2-pipeline-m{m}-b32": (
            2,
            ["--preset", "gpt-24l", "--batch-size", "32", "--strategy", "pipeline", "--micro-batches", str(m)],
        )
        for m in (2, 4)
    },
    **{
        f"gpt24l-2-circular{r}-b32": (
            2,
            ["--preset", "gpt-24l", "--batch-size", "32", "--strategy", "pipeline", "--micro-batches", "8", "--pipeline-repeats", str(r)],
        )
        for r in (2, 3, 4)
    },
    # Fewer, larger micro-batches (8 rows each) with more repeats: as short a bubble, fewer ticks.
    **{
        f"gpt24l-2-circular{r}-m4-b32": (
            2,
            ["--preset", "gpt-24l", "--batch-size", "32", "--strategy", "pipeline", "--micro-batches", "4", "--pipeline-repeats", str(r)],
        )
        for r in (2, 3, 4, 6, 12)
    },
    **{
        f"gpt24l-2-circular{r}-m2-b32": (
            2,
            ["--preset", "gpt-24l", "--batch-size", "32", "--strategy", "pipeline", "--micro-batches", "2", "--pipeline-repeats", str(r)],
        )
        for r in (6, 12)
    },
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


PROFILED = (20, 3)  # --kernels: the steps traced


def kernel_times(run_dir: str) -> dict:
    """{hlo op: {"us": kernel microseconds a step, "kernels": kernels a step}} on the first GPU's timeline."""
    from alpa_job.record import trace_summary

    traces = sorted(glob.glob(os.path.join(run_dir, "profile", "**", "*.trace.json.gz"), recursive=True))
    if not traces:
        return {}
    _, by_device = trace_summary.timelines(trace_summary.load_events(traces[-1]))
    if not by_device:
        return {}
    first = sorted(by_device)[0]
    total: dict = collections.defaultdict(lambda: [0.0, 0])
    for e in by_device[first]:
        op = str(e.get("args", {}).get("hlo_op", "")) or e.get("name", "")
        total[op][0] += float(e["dur"])
        total[op][1] += 1
    steps = PROFILED[1]
    return {op: {"us": round(us / steps, 3), "kernels": count / steps} for op, (us, count) in total.items()}


def keep_kernels(name: str, run_dir: str, dump_dir: str, into: str) -> None:
    """The case's optimized step HLO (gzipped) and its kernel times, under `into`."""
    dumped = sorted(glob.glob(os.path.join(dump_dir, "*train_step*after_optimizations.txt")), key=os.path.getsize)
    if dumped:
        with open(dumped[-1], "rb") as src, gzip.open(os.path.join(into, f"{name}.hlo.txt.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    with open(os.path.join(into, f"{name}.kernels.json"), "w") as f:
        json.dump(kernel_times(run_dir), f)


def run_case(name: str, gpus: int, flags, steps: int, timeout_s: float, scratch: str, kernels: str = "") -> dict:
    out = os.path.join(scratch, name)
    argv = [sys.executable, "-m", "alpa_job", "train", "--address", "none", "--steps", str(steps), "--compile-cache", "none"]
    argv += ["--quiet", "--no-tensorboard", "--out", out, *flags]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, range(gpus))))
    dump_dir = os.path.join(scratch, name + "-dump")
    for stale in (out, dump_dir):  # a failed run must not report the last one's files
        shutil.rmtree(stale, ignore_errors=True)
    if kernels:
        argv += ["--profile", f"{PROFILED[0]}:{PROFILED[1]}"]
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} --xla_dump_hlo_module_re=.*train_step.*".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *EXAMPLES, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-600:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", ""
    row = {"case": name, "gpus": gpus, "flags": flags, "rc": rc, "wall_s": round(time.perf_counter() - start, 1)}
    if kernels:
        keep_kernels(name, out, dump_dir, kernels)
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
    parser.add_argument("--kernels", action="store_true", help="also save each case's HLO and kernel times")
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(str(REPO), "bench", "results")))
    args = parser.parse_args()
    kernels = os.path.join(args.scratch, "kernels") if args.kernels else ""
    if kernels:
        shutil.rmtree(kernels, ignore_errors=True)
        os.makedirs(kernels)
    rows = []
    for name in args.cases:
        gpus, flags = CASES[name]
        rows.append(run_case(name, gpus, flags, args.steps, args.timeout, args.scratch, kernels))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| case | GPUs | step ms | peak GB | XLA's estimate GB | wall s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['gpus']} | {r.get('step_ms')} | {r.get('peak_gb')} | {r.get('estimate_gb')} | {r['wall_s']} |")
    saved = save_result("gpu_planner_validation", args.out, {"steps": args.steps, "cases": rows})
    print("saved", saved)
    if kernels:
        archive = saved.replace("gpu_planner_validation-", "kernels-").replace(".json", ".tar.gz")
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(kernels, arcname="kernels")
        print("saved", archive)


if __name__ == "__main__":
    main()
