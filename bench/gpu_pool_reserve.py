"""What a GPU's memory pool costs a fresh process: the age of a `import jax; jax.devices()` process when its
devices are open, and when its first buffer is on the device (the allocator reserves its pool then), for
several pool sizes (XLA_PYTHON_CLIENT_MEM_FRACTION), and with the pool grown on demand
(XLA_PYTHON_CLIENT_PREALLOCATE=false) by one buffer of a given size, freed at once.

    python3 bench/gpu_pool_reserve.py --fractions 0.75 0.5 0.25 0.1 --grow-gb 10 30 60 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

AGE = (
    "import os\n"
    "def age():\n"
    "    start = float(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])\n"
    "    return float(open('/proc/uptime').read().split()[0]) - start / os.sysconf('SC_CLK_TCK')\n"
)
PROBE = AGE + (
    "import sys, time, jax, jax.numpy as jnp, numpy\n"
    "jax.devices(); opened = age()\n"
    "gb = float(sys.argv[1])\n"
    "t = time.perf_counter()\n"
    "if gb > 0:\n"
    "    x = jnp.empty((int(gb * 2**30) // 4,), jnp.float32); x.block_until_ready(); del x\n"
    "jax.device_put(numpy.zeros((), numpy.int32)).block_until_ready()\n"
    "print(opened, age(), time.perf_counter() - t)\n"
)


def probe(env_extra: dict, gb: float) -> dict:
    env = {**os.environ, **env_extra}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(gb)], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    opened, buffered, alloc = map(float, proc.stdout.split()[-3:])
    return {"devices_open_at_s": round(opened, 3), "first_buffer_at_s": round(buffered, 3), "first_buffers_s": round(alloc, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.75, 0.5, 0.25, 0.1])
    parser.add_argument("--grow-gb", type=float, nargs="*", default=[0, 10, 30, 60])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()
    probe({}, 0)  # reads jax's files from disk once; not counted
    cases = [(f"reserve {f}", {"XLA_PYTHON_CLIENT_MEM_FRACTION": str(f)}, 0.0) for f in args.fractions]
    cases += [(f"grow by {gb:g} GB", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, gb) for gb in args.grow_gb]
    rows = []
    print(f"{'case':<18} {'open s':>7} {'first buffer s':>15} {'pool s':>7}")
    for name, env, gb in cases:
        runs = [probe(env, gb) for _ in range(args.repeats)]
        good = [r for r in runs if "error" in r] or runs
        if any("error" in r for r in runs):
            print(name, "failed:", runs[0].get("error", "")[-300:])
            rows.append({"case": name, "runs": runs})
            continue
        pool = statistics.median(r["first_buffers_s"] for r in runs)
        row = {"case": name, "env": env, "grow_gb": gb, "runs": runs, "median_pool_s": round(pool, 3)}
        rows.append(row)
        print(
            f"{name:<18} {statistics.median(r['devices_open_at_s'] for r in good):7.3f} "
            f"{statistics.median(r['first_buffer_at_s'] for r in good):15.3f} {pool:7.3f}"
        )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu_pool_reserve-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json")
    with open(path, "w") as f:
        json.dump({"cases": rows}, f, indent=1)
    print("saved", path)


if __name__ == "__main__":
    main()
