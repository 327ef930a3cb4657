"""A warm start against its floor (issue 40 item 6): how long a fresh `python -m alpa_job train` process
takes to its first step with a warm compile cache, against a process that only imports jax and opens the
GPU, and where the difference goes.

Runs, each a fresh process, in one call:
- floor: `import jax; jax.devices()`, timed as the process's age when the devices are open (what the run's
  `process_to_first_step` counts from), then with the kit's modules imported too; one before the cold run
  and one before each warm run (after one left out: it reads jax's files from disk).
- cold: `python3 -m alpa_job train --address none --preset P --steps N --compile-cache DIR`, an empty DIR.
- warm (x`--warm`): the same command, the same DIR.
- sampled (`--sample`): one more warm run under bench/startup_sampler.py, every thread's stack every 5 ms;
  its segments up to the first step are in the result.
- resume (`--resume`): a warm run that saves a checkpoint at step N, then one that resumes it to 2N
  (same step key: the schedule's horizon is the epochs', longer than 2N), for restore against random init.
- `--kit DIR`: run another checkout's kit (e.g. the code before a change) with this same driver.

    python3 bench/gpu_warm_start.py --preset gpt-24l --steps 20 --warm 3 --sample --resume
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
AGE = (
    "def age():\n"
    "    start = float(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])\n"
    "    return float(open('/proc/uptime').read().split()[0]) - start / os.sysconf('SC_CLK_TCK')\n"
)
FLOOR = "import os\n" + AGE + "import jax\njax.devices()\nprint(age())\n"
FIRST_BUFFER = "import numpy\njax.device_put(numpy.zeros((), numpy.int32)).block_until_ready()\nprint(age())\n"
KIT = "import alpa_job.cli, alpa_job.launch.runner, alpa_job.train.loop, alpa_job.engines.jax_engine\nprint(age())\n"


def run(cmd, env, cwd) -> tuple:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    return proc, round(time.perf_counter() - start, 3)


def floor(env, kit: str) -> dict:
    """One floor process: its age when the devices are open and when a first buffer is on the device (its
    allocator reserves its pool then), and how long the kit's modules take to import after that."""
    proc, wall = run([sys.executable, "-c", FLOOR + FIRST_BUFFER + KIT], env, kit)
    lines = proc.stdout.split()
    if proc.returncode != 0 or len(lines) < 3:
        return {"error": proc.stderr[-2000:]}
    return {
        "devices_open_at_s": float(lines[0]),
        "first_buffer_at_s": float(lines[1]),
        "kit_imported_too_s": round(float(lines[2]) - float(lines[1]), 3),
        "process_wall_s": wall,
    }


def floor_summary(rows: list) -> dict:
    rows = [r for r in rows if "error" not in r]
    out = {"runs": rows}
    for key in ("devices_open_at_s", "first_buffer_at_s", "kit_imported_too_s"):
        out[f"median_{key}"] = round(statistics.median(r[key] for r in rows), 3) if rows else None
    return out


def train(args, env, name: str, extra=(), prefix=()) -> dict:
    out = os.path.join(args.scratch, name)
    cmd = [
        *(prefix or [sys.executable, "-m", "alpa_job"]),
        "train",
        "--address",
        "none",
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--compile-cache",
        os.path.join(args.scratch, "cache"),
        "--out",
        out,
        *args.train_args,
        *extra,
    ]
    proc, wall = run(cmd, env, args.kit)
    if proc.returncode != 0:
        return {"run": name, "wall_s": wall, "error": proc.stderr[-3000:]}
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    timing = report["timing"]
    return {
        "run": name,
        "wall_s": wall,
        "phases_s": timing["phases_s"],
        "compile_cache": timing.get("compile_cache"),
        "startup": timing.get("startup"),
        "steady_median_ms": round((timing.get("steady_step") or {}).get("median_s", 0) * 1e3, 1),
        "loss_first5": report["losses"][:5],
        "compiles_in_loop": report["backend_compiles_during_loop"],
        "progress_tail": proc.stderr[-1500:] + proc.stdout[-600:],
    }


def sampled(args, env) -> dict:
    samples = os.path.join(args.scratch, "samples.json")
    prefix = [sys.executable, os.path.join(HERE, "startup_sampler.py"), samples, "--"]
    row = train(args, env, "warm-sampled", prefix=prefix)
    if "error" in row:
        return row
    from startup_sampler import summarise  # bench/ is on the path of `python bench/NAME.py`

    until = row["phases_s"].get("process_to_first_step") or 60.0
    row["segments"] = summarise(samples, until + 0.05)
    shutil.copy(samples, os.path.join(args.out, "warm_start-samples.json"))
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt-24l")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm", type=int, default=3, help="warm runs after the cold one")
    parser.add_argument("--floors", type=int, default=1, help="floor processes before the cold run (one more before each warm run)")
    parser.add_argument("--sample", action="store_true", help="one more warm run under the stack sampler")
    parser.add_argument("--resume", action="store_true", help="a checkpointed warm run, then a resumed one")
    parser.add_argument("--kit", default=REPO, help="the checkout whose kit runs (default: this one)")
    parser.add_argument("--label", default="")
    parser.add_argument("--scratch", default=None)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args, args.train_args = parser.parse_known_args()  # the rest goes to every train command
    args.kit = os.path.abspath(args.kit)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    args.scratch = args.scratch or tempfile.mkdtemp(prefix="warmstart-")
    env = dict(os.environ, PYTHONPATH=args.kit, PYTHONUNBUFFERED="1")
    # The floor's processes alternate with the warm runs (the machine's pace drifts between calls); the first,
    # which reads jax's files from disk, is left out.
    first_floor = floor(env, args.kit)
    result = {"label": args.label, "kit": args.kit, "first_floor": first_floor, "runs": []}
    floors = [floor(env, args.kit) for _ in range(args.floors)]
    result["runs"].append(train(args, env, "cold"))
    for i in range(args.warm):
        floors.append(floor(env, args.kit))
        result["runs"].append(train(args, env, f"warm{i + 1}"))
        print(json.dumps({k: v for k, v in result["runs"][-1].items() if k != "progress_tail"}), flush=True)
    result["floor"] = floor_summary(floors)
    print(json.dumps(result["floor"]), flush=True)
    if args.sample:
        result["runs"].append(sampled(args, env))
    if args.resume:
        result["runs"].append(train(args, env, "warm-ckpt", ["--checkpoint-every", str(args.steps)]))
        result["runs"].append(
            train(args, env, "warm-ckpt", ["--steps", str(2 * args.steps), "--resume", "--checkpoint-every", str(args.steps)])
        )
        result["runs"][-1]["run"] = "warm-resumed"
    from lib.results import save_result

    path = save_result("gpu_warm_start" + (f"-{args.label}" if args.label else ""), args.out, result)
    print(path)
    table(result)


def table(result: dict) -> None:
    floor_s = result["floor"].get("median_devices_open_at_s")
    print(
        f"floor (import jax, open the GPU): {floor_s} s; with a first buffer on the device: "
        f"{result['floor'].get('median_first_buffer_at_s')} s; the kit's modules import in "
        f"{result['floor'].get('median_kit_imported_too_s')} s more"
    )
    print(
        "| run | process to first step s | - floor s | to first step (train start) | compile/load | "
        "init compile | init or restore | first step | steady ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["runs"]:
        if "error" in r:
            print(f"| {r['run']} | failed: {r['error'][-300:]!r} |")
            continue
        p = r["phases_s"]
        first = p.get("process_to_first_step")
        print(
            f"| {r['run']} | {first} | {round(first - floor_s, 2) if first and floor_s else '-'} | "
            f"{p.get('to_first_step')} | {p.get('compile')} | {p.get('init_compile')} | "
            f"{p.get('init_or_restore')} | {p.get('first_step')} | {r['steady_median_ms']} |"
        )
    warm = [
        r["phases_s"]["process_to_first_step"]
        for r in result["runs"]
        if r["run"].startswith("warm") and r["run"][4:].isdigit() and "error" not in r
    ]
    if warm and floor_s:
        median = statistics.median(warm)
        print(f"warm runs' median {median:.2f} s to the first step, floor {floor_s:.2f} s: difference {median - floor_s:.2f} s")


if __name__ == "__main__":
    main()
