"""What gradient-sized communication costs the matmuls it overlaps: NCCL all-reduce vs copy-engine exchange.

Two devices of one process each run a chain of bf16 matmuls (the backward's stand-in) while a
data-parallel gradient's bytes are summed across them, chunk by chunk as the chain produces them:
- `psum`: XLA's all-reduce (NCCL kernels, which take SMs from the matmuls);
- `ppermute`: each device sends the other its half, adds, and sends its summed half back, as two
  collective-permutes, which `--xla_gpu_use_memcpy_local_p2p=true` turns into peer memcpys on the copy
  engines (no SMs).
Rows: the matmuls alone, each exchange alone, and each beside the matmuls; the cost of an exchange
is (beside - matmuls alone). Run with XLA_FLAGS=--xla_gpu_use_memcpy_local_p2p=true for the copy engines.
Each row also gives the GPUs' mean SM clock and power draw over its timed repeats (nvidia-smi): a clock
that falls beside the exchange, with the power at its limit, says the cost is the power cap's, which no
schedule or transport can hide; an unchanged clock says SMs or memory were taken.

  python3 bench/gpu_overlap.py [--gradient-gb 2.5] [--chunks 24] [--matmuls 60] [--size 8192] [--random-inputs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from lib.results import save_result

try:
    from jax import shard_map
except ImportError:  # jax before shard_map moved out of experimental
    from jax.experimental.shard_map import shard_map


def exchange_psum(chunk):
    return jax.lax.psum(chunk, "d")


def exchange_ppermute(chunk):
    """Two-device all-reduce as two collective-permutes: swap halves, add, swap the sums back."""
    me = jax.lax.axis_index("d")
    half = chunk.shape[0] // 2
    mine = jnp.where(me == 0, chunk[:half], chunk[half:])
    theirs = jnp.where(me == 0, chunk[half:], chunk[:half])
    summed = mine + jax.lax.ppermute(theirs, "d", [(0, 1), (1, 0)])
    other_sum = jax.lax.ppermute(summed, "d", [(0, 1), (1, 0)])
    return jnp.where(me == 0, jnp.concatenate([summed, other_sum]), jnp.concatenate([other_sum, summed]))


def body(x, w, grads, matmuls: int, exchange):
    """`matmuls` matmuls; after each of the first len(grads), that chunk is exchanged (it depends on the
    matmul's output so it cannot start earlier, like a gradient leaving the backward)."""
    out = []
    for i in range(matmuls):
        x = jnp.tanh(x @ w)
        if exchange is not None and i < len(grads):
            out.append(exchange(grads[i] + x[0, 0].astype(grads[i].dtype)))
    return x, out


def make_step(mesh, matmuls: int, exchange, with_compute: bool):
    def local(x, w, grads):
        if with_compute:
            return body(x, w, grads, matmuls, exchange)
        return x, [exchange(g) for g in grads]

    spec = P("d")
    mapped = shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec))
    return jax.jit(mapped)


class ClockSampler:
    """Mean SM clock (MHz) and power draw (W) of the GPUs while the block runs, from nvidia-smi every
    50 ms; empty where nvidia-smi is missing."""

    QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,power.limit", "--format=csv,noheader,nounits", "-lms", "50"]

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(self.QUERY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        time.sleep(0.2)  # its first sample comes before the block's work
        return self

    def __exit__(self, *exc):
        self.result = {}
        if self.proc is None:
            return
        self.proc.terminate()
        samples = []
        for line in self.proc.communicate(timeout=10)[0].splitlines():
            try:
                samples.append([float(v) for v in line.split(",")])
            except ValueError:
                continue
        if samples:
            self.result = {
                "sm_mhz": round(statistics.mean(s[0] for s in samples)),
                "power_w": round(statistics.mean(s[1] for s in samples)),
                "power_limit_w": round(max(s[2] for s in samples)),
            }


def time_step(step, args, repeats: int):
    """(median seconds, the clocks over the timed repeats)."""
    jax.block_until_ready(step(*args))  # compile + warm-up
    jax.block_until_ready(step(*args))
    times = []
    with ClockSampler() as clocks:
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times.append(time.perf_counter() - start)
    return statistics.median(times), clocks.result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gradient-gb", type=float, default=2.5, help="bf16 gradient bytes a device sums")
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--matmuls", type=int, default=60)
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--random-inputs", action="store_true", help="normal random matmul inputs (a model's power draw) instead of constants"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args()

    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("d",))
    n = len(devices)
    per_chunk = int(args.gradient_gb * 2**30 / 2 / args.chunks) // 2 * 2
    if args.random_inputs:
        keys = jax.random.split(jax.random.PRNGKey(0))
        x = jax.random.normal(keys[0], (n * args.size, args.size), jnp.bfloat16)
        w = jax.random.normal(keys[1], (n * args.size, args.size), jnp.bfloat16) / args.size**0.5
    else:
        x = jnp.ones((n * args.size, args.size), jnp.bfloat16) * 0.01
        w = jnp.ones((n * args.size, args.size), jnp.bfloat16) * 0.001
    grads = [jnp.ones((n * per_chunk,), jnp.bfloat16) for _ in range(args.chunks)]

    def put(a):
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, P("d")))

    x, w, grads = put(x), put(w), [put(g) for g in grads]

    rows = []
    for name, exchange, with_compute in (
        ("matmuls alone", None, True),
        ("psum alone", exchange_psum, False),
        ("ppermute alone", exchange_ppermute, False),
        ("matmuls + psum", exchange_psum, True),
        ("matmuls + ppermute", exchange_ppermute, True),
    ):
        step = make_step(mesh, args.matmuls, exchange, with_compute)
        seconds, clocks = time_step(step, (x, w, grads), args.repeats)
        rows.append({"run": name, "ms": round(seconds * 1e3, 2), **clocks})
        print(rows[-1], flush=True)
    alone = rows[0]["ms"]
    print(
        f"\n{n} x {devices[0].device_kind}, {args.gradient_gb} GB bf16 in {args.chunks} chunks, "
        f"{args.matmuls} matmuls of {args.size}^3; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    print(f"{'run':22s} {'ms':>8s} {'cost ms':>8s} {'SM MHz':>7s} {'W':>5s} {'limit W':>8s}")
    for r in rows:
        r["cost_ms"] = round(r["ms"] - alone, 2) if r["run"].startswith("matmuls +") else None
        print(
            f"{r['run']:22s} {r['ms']:8.2f} {r['cost_ms'] if r['cost_ms'] is not None else '-':>8} "
            f"{r.get('sm_mhz', '-'):>7} {r.get('power_w', '-'):>5} {r.get('power_limit_w', '-'):>8}"
        )
    print("saved", save_result("gpu_overlap", args.out, {"rows": rows, "xla_flags": os.environ.get("XLA_FLAGS", ""), "args": vars(args)}))


if __name__ == "__main__":
    main()
