"""The CLI end to end on one GPU, cold then warm: time to first step, the phases, the compile cache,
the steady step and the loss at defaults (issue 16, items 2-5).

Runs `python3 -m alpa_job train --address none --preset PRESET --steps N --compile-cache DIR` in fresh
processes: first with an empty cache folder (cold), then `--warm` more times with the same folder.
Also times the floor no run can go under: a process that only imports jax, flax and optax and opens
the GPU (`jax.devices()`).

    python3 bench/gpu_cli_cache.py --preset gpt-24l --steps 50 --warm 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from lib.results import save_result

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOOR = "import time; t = time.perf_counter(); import jax, flax, optax; jax.devices(); print(time.perf_counter() - t)"


def run(cmd, env) -> tuple:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=580)
    return proc, round(time.perf_counter() - start, 2)


def train(args, cache: str, name: str, env) -> dict:
    out = os.path.join(args.scratch, name)
    cmd = [
        sys.executable,
        "-m",
        "alpa_job",
        "train",
        "--address",
        "none",
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--compile-cache",
        cache,
        "--out",
        out,
    ]
    proc, wall = run(cmd, env)
    if proc.returncode != 0:
        return {"run": name, "wall_s": wall, "error": proc.stderr[-2000:]}
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    losses = report["losses"]
    return {
        "run": name,
        "wall_s": wall,
        "timing": report["timing"],
        "compile_seconds": report["compile_seconds"],
        "loss_first5": losses[:5],
        "loss_last5": losses[-5:],
        "backend_compiles_during_loop": report["backend_compiles_during_loop"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt-24l")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warm", type=int, default=2, help="warm runs after the cold one")
    parser.add_argument("--scratch", default=None, help="folder for the runs and the cache (default: a new temp folder)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    args.scratch = args.scratch or tempfile.mkdtemp(prefix="clicache-")
    env = dict(os.environ, PYTHONPATH=REPO)
    cache = os.path.join(args.scratch, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    rows = []
    floor_proc, floor_wall = run([sys.executable, "-c", FLOOR], env)
    rows.append(
        {
            "run": "floor: import jax+flax+optax, open the GPU",
            "wall_s": floor_wall,
            "import_and_devices_s": float(floor_proc.stdout.strip() or "nan"),
        }
    )
    print(json.dumps(rows[-1]), flush=True)
    for name in ["cold"] + [f"warm{i + 1}" for i in range(args.warm)]:
        rows.append(train(args, cache, name, env))
        print(json.dumps(rows[-1]), flush=True)

    save_result("gpu_cli_cache", args.out, {"rows": rows})
    print(
        "| run | wall s | to first step (train start / process start) | step compile | init compile | "
        "first step | steady ms (p10-p90) | MFU | step from |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows[1:]:
        if "error" in r:
            print(f"| {r['run']} | {r['wall_s']} | failed |")
            continue
        t, p = r["timing"], r["timing"]["phases_s"]
        steady = t["steady_step"] or {}
        print(
            f"| {r['run']} | {r['wall_s']} | {p['to_first_step']} / {p.get('process_to_first_step')} | "
            f"{p['compile']} | {p['init_compile']} | {p['first_step']} | "
            f"{round(steady.get('median_s', 0) * 1e3, 1)} ({round(steady.get('p10_s', 0) * 1e3, 1)}-"
            f"{round(steady.get('p90_s', 0) * 1e3, 1)}) | {t['mfu']} | {(t.get('compile_cache') or {}).get('step')} |"
        )


if __name__ == "__main__":
    main()
